"""Pure-PyTorch implementations of nanfree's ops: the same stable algorithms as
the C++, CUDA and Triton kernels, for any device no compiled kernel covers."""
