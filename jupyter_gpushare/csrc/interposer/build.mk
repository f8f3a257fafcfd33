# libgpushare.so: the CUDA interposer (box 7). Sanitizer variants for the tests:
#   make -C jupyter_gpushare/csrc interposer-asan interposer-tsan
GS_DIR := $(CURDIR)/interposer
GS_SRC := $(GS_DIR)/dispatch.c $(GS_DIR)/lease.c $(GS_DIR)/launch.c $(GS_DIR)/memory.c
GS_HDR := $(GS_DIR)/gs.h $(CURDIR)/include/gpushare_wire.h $(CURDIR)/include/gpushare_cuda.h
GS_LDFLAGS := -shared -Wl,-Bsymbolic-functions -Wl,--no-undefined -ldl -lpthread
ALL += $(LIB)/libgpushare.so $(LIB)/test/gs_bench

$(LIB)/libgpushare.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)
	$(CC) $(CFLAGS) $(BASEFLAGS) -fvisibility=default -o $@ $(GS_SRC) $(GS_LDFLAGS)

$(LIB)/test/libgpushare-asan.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined $(BASEFLAGS) -o $@ $(GS_SRC) -shared -Wl,-Bsymbolic-functions -ldl -lpthread

$(LIB)/test/libgpushare-tsan.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O1 -g -fsanitize=thread $(BASEFLAGS) -o $@ $(GS_SRC) -shared -Wl,-Bsymbolic-functions -ldl -lpthread

# Test and benchmark programs: load the driver with dlopen (through our dlsym) like frameworks do.
$(LIB)/test/gs_stress: $(GS_DIR)/tests/gs_stress.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) $(CFLAGS) $(BASEFLAGS) -o $@ $< -ldl -lpthread

$(LIB)/test/gs_stress-asan: $(GS_DIR)/tests/gs_stress.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O1 -g -fsanitize=address,undefined $(BASEFLAGS) -o $@ $< -ldl -lpthread

$(LIB)/test/gs_stress-tsan: $(GS_DIR)/tests/gs_stress.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O1 -g -fsanitize=thread $(BASEFLAGS) -o $@ $< -ldl -lpthread

$(LIB)/test/gs_bench: $(GS_DIR)/tests/gs_bench.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O2 $(BASEFLAGS) -o $@ $< -ldl -lpthread

.PHONY: interposer-asan interposer-tsan
interposer-asan: $(LIB)/test/libgpushare-asan.so $(LIB)/test/gs_stress-asan
interposer-tsan: $(LIB)/test/libgpushare-tsan.so $(LIB)/test/gs_stress-tsan
