# The GPU simulator: stand-ins for libcuda.so.1 and libnvidia-ml.so.1 in _lib/sim/ (`make sim`
# builds only these).
# `make asan` / `make tsan` (or sim-asan / sim-tsan) build sanitizer variants of both libraries
# outside the package, in build/sanitize/sim-{asan,tsan}/ at the repository root.
SIM_DIR := $(CURDIR)/simulator
SIM_OUT := $(LIB)/sim
SIM_SAN := $(abspath $(CURDIR)/../../build/sanitize)
SIM_COMMON := $(SIM_DIR)/sim_state.c $(SIM_DIR)/product.c
SIM_CUDA_SRC := $(SIM_DIR)/cuda_context.c $(SIM_DIR)/cuda_module.c $(SIM_DIR)/cuda_stream.c \
                $(SIM_DIR)/cuda_event.c $(SIM_DIR)/cuda_graph.c $(SIM_DIR)/cuda_memory.c \
                $(SIM_DIR)/cuda_copy.c $(SIM_DIR)/cuda_entry.c $(SIM_COMMON)
SIM_NVML_SRC := $(SIM_DIR)/nvml.c $(SIM_DIR)/nvml_telemetry.c $(SIM_COMMON)
SIM_HDRS := $(wildcard $(SIM_DIR)/*.h) $(CURDIR)/include/gpushare_cuda.h \
            $(CURDIR)/include/gpushare_nvml.h
SIM_FLAGS := $(BASEFLAGS) -fvisibility=hidden -shared -Wl,--no-undefined

$(SIM_OUT)/libcuda.so.1: $(SIM_CUDA_SRC) $(SIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) $(SIM_FLAGS) -Wl,-soname,libcuda.so.1 -o $@ $(SIM_CUDA_SRC)

$(SIM_OUT)/libnvidia-ml.so.1: $(SIM_NVML_SRC) $(SIM_HDRS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS) $(SIM_FLAGS) -Wl,-soname,libnvidia-ml.so.1 -o $@ $(SIM_NVML_SRC)

$(SIM_OUT)/libcuda.so: $(SIM_OUT)/libcuda.so.1
	ln -sf libcuda.so.1 $@

$(SIM_OUT)/libnvidia-ml.so: $(SIM_OUT)/libnvidia-ml.so.1
	ln -sf libnvidia-ml.so.1 $@

ALL += $(SIM_OUT)/libcuda.so.1 $(SIM_OUT)/libnvidia-ml.so.1 $(SIM_OUT)/libcuda.so \
       $(SIM_OUT)/libnvidia-ml.so

.PHONY: sim
sim: $(SIM_OUT)/libcuda.so.1 $(SIM_OUT)/libnvidia-ml.so.1 $(SIM_OUT)/libcuda.so \
     $(SIM_OUT)/libnvidia-ml.so

# Sanitizer variants (same sources, instrumented, unoptimised enough to give good reports).
define SIM_SANITIZED
$(SIM_SAN)/sim-$(1)/libcuda.so.1: $(SIM_CUDA_SRC) $(SIM_HDRS)
	@mkdir -p $$(@D)
	$(CC) -O1 -g -fno-omit-frame-pointer -fsanitize=$(2) $(SIM_FLAGS:-Wl,--no-undefined=) \
	    -Wl,-soname,libcuda.so.1 -o $$@ $(SIM_CUDA_SRC)
$(SIM_SAN)/sim-$(1)/libnvidia-ml.so.1: $(SIM_NVML_SRC) $(SIM_HDRS)
	@mkdir -p $$(@D)
	$(CC) -O1 -g -fno-omit-frame-pointer -fsanitize=$(2) $(SIM_FLAGS:-Wl,--no-undefined=) \
	    -Wl,-soname,libnvidia-ml.so.1 -o $$@ $(SIM_NVML_SRC)
.PHONY: sim-$(1) $(1)
sim-$(1): $(SIM_SAN)/sim-$(1)/libcuda.so.1 $(SIM_SAN)/sim-$(1)/libnvidia-ml.so.1
$(1): sim-$(1)
endef
sim_comma := ,
$(eval $(call SIM_SANITIZED,asan,address$(sim_comma)undefined))
$(eval $(call SIM_SANITIZED,tsan,thread))
