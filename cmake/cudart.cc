// The one source of libaotinfer_cudart.so, which CMake needs to make a library: its content is the
// static CUDA runtime, linked whole from cmake/cudart.py's libcudart_exportable.a (CMakeLists.txt).
