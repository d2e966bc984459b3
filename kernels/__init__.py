"""The project's own Triton kernels, shipped as ``dsinfer.kernels``.

ops/ selects a kernel from here only on a GPU, and only when this package provides it (checked by
name). Each kernel will come with a torch reference test that also runs on CPU under
``TRITON_INTERPRET=1``. None is provided yet: until then every op runs its torch reference.
"""
