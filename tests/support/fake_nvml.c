/* A fake libnvidia-ml.so.1 for tests: one H100 answering the NVML entry points the exporter calls, as a
 * driver may answer them, so that nvidia-ml-py's own code (library loading, argument marshalling, the
 * two-call size protocol, error mapping) runs. Entry points not defined here are absent: pynvml raises
 * NVMLError_FunctionNotFound for them. Values follow the monotonic clock:
 *   - PCIe byte counters (fields 197/198) are answered at 32 bits (NVML_VALUE_TYPE_UNSIGNED_INT) and move at
 *     FAKE_PCIE_TX / FAKE_PCIE_RX bytes per second: TX wraps more than once a second;
 *   - the energy counter (field 83) grows at FAKE_WATTS, the instantaneous power (186) reads FAKE_INSTANT_MW;
 *   - the caller's own process is listed as a compute process; nvmlDeviceGetProcessUtilization answers
 *     SUCCESS with no samples (which pynvml raises as NVMLError(0)).
 * Built by tests/support/fake_libnvml.py with gcc; never shipped. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAKE_PCIE_TX 6.0e9
#define FAKE_PCIE_RX 2.5e9
#define FAKE_WATTS 300.0
#define FAKE_INSTANT_MW 450000u

enum { SUCCESS = 0, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7 };
enum { TYPE_UNSIGNED_INT = 1, TYPE_UNSIGNED_LONG_LONG = 3 };

typedef struct { int index; } device_t;
typedef union { double d; unsigned int ui; unsigned long ul; unsigned long long ull; long long sll; } value_t;
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType, nvmlReturn;
    value_t value;
} field_value_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} process_t;

static device_t gpu0 = {0};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static unsigned long long as_count(double count) { return (unsigned long long)count; }

static int copy(char *to, unsigned int length, const char *text) {
    if (strlen(text) + 1 > length) return INSUFFICIENT_SIZE;
    strcpy(to, text);
    return SUCCESS;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case SUCCESS: return "Success";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return SUCCESS; }
int nvmlInit_v2(void) { return SUCCESS; }
int nvmlShutdown(void) { return SUCCESS; }
int nvmlSystemGetDriverVersion(char *version, unsigned int length) { return copy(version, length, "550.54.15"); }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 1; return SUCCESS; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, device_t **device) {
    if (index != 0) return INVALID_ARGUMENT;
    *device = &gpu0;
    return SUCCESS;
}

int nvmlDeviceGetName(device_t *device, char *name, unsigned int length) {
    (void)device;
    return copy(name, length, "NVIDIA H100 80GB HBM3");
}

int nvmlDeviceGetUUID(device_t *device, char *uuid, unsigned int length) {
    (void)device;
    return copy(uuid, length, "GPU-11111111-2222-3333-4444-555555555555");
}

int nvmlDeviceGetMemoryInfo(device_t *device, memory_t *memory) {  /* v1 only, as before R510 */
    (void)device;
    memory->total = 80ull << 30;
    memory->used = 20ull << 30;
    memory->free = memory->total - memory->used;
    return SUCCESS;
}

int nvmlDeviceGetFieldValues(device_t *device, int count, field_value_t *values) {
    (void)device;
    double t = now();
    for (int i = 0; i < count; i++) {
        field_value_t *v = &values[i];
        v->timestamp = (long long)(t * 1e6);
        v->nvmlReturn = SUCCESS;
        switch (v->fieldId) {
        case 197: v->valueType = TYPE_UNSIGNED_INT; v->value.ui = (unsigned int)as_count(FAKE_PCIE_TX * t); break;
        case 198: v->valueType = TYPE_UNSIGNED_INT; v->value.ui = (unsigned int)as_count(FAKE_PCIE_RX * t); break;
        case 83: v->valueType = TYPE_UNSIGNED_LONG_LONG; v->value.ull = as_count(FAKE_WATTS * t * 1000); break;
        case 186: v->valueType = TYPE_UNSIGNED_INT; v->value.ui = FAKE_INSTANT_MW; break;
        case 190: v->valueType = TYPE_UNSIGNED_INT; v->value.ui = 700000; break;
        default: v->nvmlReturn = NOT_SUPPORTED;
        }
    }
    return SUCCESS;
}

int nvmlDeviceGetPcieThroughput(device_t *device, int counter, unsigned int *kib_per_second) {
    (void)device;
    *kib_per_second = (unsigned int)((counter == 0 ? FAKE_PCIE_TX : FAKE_PCIE_RX) / 1024);
    return SUCCESS;
}

int nvmlDeviceGetComputeRunningProcesses_v3(device_t *device, unsigned int *count, process_t *infos) {
    (void)device;
    if (infos == NULL || *count < 1) {
        *count = 1;
        return INSUFFICIENT_SIZE;
    }
    *count = 1;
    infos[0] = (process_t){(unsigned int)getpid(), 1ull << 30, 0xFFFFFFFFu, 0xFFFFFFFFu};
    return SUCCESS;
}

int nvmlDeviceGetProcessUtilization(device_t *device, void *samples, unsigned int *count, unsigned long long last) {
    (void)device; (void)samples; (void)last;
    *count = 0;  /* no process computed in the last sample period */
    return SUCCESS;
}
