{{/*
Names. Kept to 40 characters: LeaderWorkerSet pods are named <fullname>-<role>-<group>-<worker>
and must stay valid host names (63 characters).
*/}}
{{- define "dsinfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "dsinfer" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-dsinfer" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dsinfer.selectorLabels" -}}
app.kubernetes.io/name: dsinfer
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsinfer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "dsinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "dsinfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The internal gateway Service: probes and Prometheus read /metrics through it. It publishes
the gateway before it is ready, which it only becomes once pools have registered. */}}
{{- define "dsinfer.gatewayInternal" -}}
{{- printf "%s-gateway-internal" (include "dsinfer.fullname" .) -}}
{{- end -}}

{{- define "dsinfer.gatewayHost" -}}
{{- printf "%s.%s.svc" (include "dsinfer.gatewayInternal" .) .Release.Namespace -}}
{{- end -}}

{{/* The headless control Service: resolves to every gateway replica; the pools' --gateway-addr. */}}
{{- define "dsinfer.gatewayControl" -}}
{{- printf "%s-gateway-control" (include "dsinfer.fullname" .) -}}
{{- end -}}

{{- define "dsinfer.gatewayControlAddr" -}}
{{- printf "%s.%s.svc:%d" (include "dsinfer.gatewayControl" .) .Release.Namespace (int .Values.gateway.controlPort) -}}
{{- end -}}

{{/* The cluster secret's Secret: an existing one, or the one the chart keeps. */}}
{{- define "dsinfer.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "dsinfer.fullname" .)) -}}
{{- end -}}

{{/* $DSINFER_CLUSTER_SECRET from that Secret: the gateway and every pool hold it (env entry). */}}
{{- define "dsinfer.clusterSecretEnv" -}}
- name: DSINFER_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "dsinfer.clusterSecretName" . }}
      key: {{ .Values.clusterSecret.secretKey }}
{{- end -}}

{{- define "dsinfer.gatewayURL" -}}
{{- printf "http://%s:%d" (include "dsinfer.gatewayHost" .) (int .Values.gateway.port) -}}
{{- end -}}

{{/* --model: the mounted checkpoint when model.volume is set, else model.preset. */}}
{{- define "dsinfer.modelArg" -}}
{{- if .Values.model.volume -}}
{{- .Values.model.mountPath -}}
{{- else -}}
{{- required "model.preset or model.volume is required" .Values.model.preset -}}
{{- end -}}
{{- end -}}

{{/* A scalar flag value as text: whole numbers without an exponent (Helm reads numbers as floats). */}}
{{- define "dsinfer.scalar" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/*
A map of `dsinfer serve` flag names (dashes or underscores) to values, as a JSON list of
container arguments, keys sorted: true -> --flag, false and null -> nothing, anything else ->
--flag VALUE. Keys in .reserved are set by the chart from its own values (fail names the value
to use instead). Input: dict "args" MAP "reserved" DICT(flag -> what to use) "where" VALUES-PATH.
*/}}
{{- define "dsinfer.flags" -}}
{{- $where := .where -}}
{{- $reserved := .reserved -}}
{{- $items := list -}}
{{- range $key, $value := .args -}}
{{- $flag := replace "_" "-" $key -}}
{{- if hasKey $reserved $flag -}}
{{- fail (printf "%s.args.%s is set by the chart: use %s" $where $key (get $reserved $flag)) -}}
{{- end -}}
{{- if kindIs "bool" $value -}}
{{- if $value -}}
{{- $items = append $items (printf "--%s" $flag) -}}
{{- end -}}
{{- else if kindIs "invalid" $value -}}
{{- else if or (kindIs "map" $value) (kindIs "slice" $value) -}}
{{- fail (printf "%s.args.%s takes one value, got %v" $where $key $value) -}}
{{- else -}}
{{- $items = append $items (printf "--%s" $flag) -}}
{{- $items = append $items (include "dsinfer.scalar" $value) -}}
{{- end -}}
{{- end -}}
{{- toJson $items -}}
{{- end -}}

{{/* A role's pool settings: poolDefaults deep-merged with pools.<role>. Input: list ROOT ROLE. */}}
{{- define "dsinfer.pool" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $pool := mergeOverwrite (deepCopy $root.Values.poolDefaults) (deepCopy (index $root.Values.pools $role)) -}}
{{- toYaml $pool -}}
{{- end -}}

{{/* Ranks per node = pool size / nodes (fails when it does not divide). Input: list POOL ROLE. */}}
{{- define "dsinfer.ranksPerNode" -}}
{{- $pool := index . 0 -}}
{{- $role := index . 1 -}}
{{- $size := int $pool.poolSize -}}
{{- $nodes := int $pool.nodes -}}
{{- if or (lt $size 1) (lt $nodes 1) -}}
{{- fail (printf "pools.%s.poolSize and pools.%s.nodes must be at least 1" $role $role) -}}
{{- end -}}
{{- if ne (mod $size $nodes) 0 -}}
{{- fail (printf "pools.%s.poolSize %d is not a multiple of pools.%s.nodes %d (ranks per node = pool size / nodes)" $role $size $role $nodes) -}}
{{- end -}}
{{- div $size $nodes -}}
{{- end -}}

{{/* Non-empty when any pool role is enabled. */}}
{{- define "dsinfer.anyPool" -}}
{{- $root := . -}}
{{- range $role, $_ := .Values.pools -}}
{{- if (include "dsinfer.pool" (list $root $role) | fromYaml).enabled }}yes{{ end -}}
{{- end -}}
{{- end -}}
