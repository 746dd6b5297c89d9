"""The decoder layer's operations as pure tensor functions: torch reference ops (`ops`, any
device) and their Triton kernels (`decoder`, CUDA), which the native engine runs its families with."""
