"""Our runtime modules (CUDA/C++ sources and their build drivers); build outputs go to runtime/build/."""
