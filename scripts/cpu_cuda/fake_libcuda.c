/* A stand-in libcuda.so.1 for compiling Mosaic GPU kernels to PTX on a machine without a GPU
 * (scripts/mosaic_ptx.py). jax's CUDA plugin asks the driver for the device's compute
 * capability before it compiles; this library answers sm_90 (an H100 / H200) and fails the
 * module load that follows, by which point MOSAIC_GPU_DUMP_* has written the PTX and ptxas's
 * notes. Nothing here runs a kernel. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
static int context;
static const CUresult kNoDevice = 100; /* CUDA_ERROR_NO_DEVICE */

CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  strncpy(name, "NVIDIA H200 (fake_libcuda)", len);
  return 0;
}
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice d) {
  switch (attribute) {
    case 75: *value = 9; break;        /* COMPUTE_CAPABILITY_MAJOR */
    case 76: *value = 0; break;        /* COMPUTE_CAPABILITY_MINOR */
    case 16: *value = 132; break;      /* MULTIPROCESSOR_COUNT */
    case 97: *value = 232448; break;   /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    default: *value = 1;
  }
  return 0;
}
CUresult cuCtxGetCurrent(CUcontext *c) { *c = &context; return 0; }
CUresult cuCtxGetDevice(CUdevice *d) { *d = 0; return 0; }
CUresult cuCtxPushCurrent(CUcontext c) { return 0; }
CUresult cuCtxPopCurrent(CUcontext *c) { if (c) *c = &context; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { *c = &context; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = "fake_libcuda: no GPU here (the PTX was dumped; nothing was loaded)";
  return 0;
}
CUresult cuGetErrorName(CUresult e, const char **s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
CUresult cuModuleLoadData(void **module, const void *image) { return kNoDevice; }
CUresult cuModuleLoadDataEx(void **module, const void *image, unsigned n, void *opts,
                            void **vals) { return kNoDevice; }
CUresult cuLibraryLoadData(void **lib, const void *code, void *jit_opts, void **jit_vals,
                           unsigned n_jit, void *lib_opts, void **lib_vals, unsigned n_lib) {
  return kNoDevice;
}
