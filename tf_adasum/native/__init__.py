"""The C++ kernels and MPI ops (the .cc and .h files beside this one) and the build that compiles them."""
