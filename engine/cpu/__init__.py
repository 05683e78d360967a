"""Every native CPU piece, used only when the device is the CPU: the C kernels (csrc/), their
build, the paged attention backend `cpu`, the decoder ops, packed weights, host memory."""
