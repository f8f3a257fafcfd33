# libgpushare.so: the CUDA interposer (box 7).
# Test programs and sanitizer builds (not shipped):  make -C jupyter_gpushare/csrc interposer-tests
#   _lib/test/gs_tenant[-asan|-tsan], _lib/test/libgpushare-asan.so, _lib/test/libgpushare-tsan.so
GS_DIR := $(CURDIR)/interposer
# the interposer's C test programs live with the tests (tests/enforcement/c/)
GS_TESTS := $(abspath $(CURDIR)/../../tests/enforcement/c)
GS_SRC := $(GS_DIR)/dispatch.c $(GS_DIR)/init.c $(GS_DIR)/connect.c $(GS_DIR)/admit.c \
	$(GS_DIR)/runahead.c $(GS_DIR)/backfill.c $(GS_DIR)/drain.c $(GS_DIR)/agent.c $(GS_DIR)/launch.c $(GS_DIR)/memory.c $(GS_DIR)/release.c
GS_HDR := $(GS_DIR)/gs.h $(CURDIR)/include/gpushare_wire.h $(CURDIR)/include/gpushare_cuda.h \
	$(CURDIR)/include/glibc_baseline.h
GS_LIBS := -ldl -lpthread
GS_SO := -shared -Wl,-Bsymbolic-functions
ASAN := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined
TSAN := -O1 -g -fsanitize=thread
ALL += $(LIB)/libgpushare.so

$(LIB)/libgpushare.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)
	$(CC) $(CFLAGS) $(BASEFLAGS) -include $(CURDIR)/include/glibc_baseline.h -o $@ $(GS_SRC) \
	    $(GS_SO) -Wl,--no-undefined -Wl,--no-as-needed -l:libdl.so.2 -l:libpthread.so.0 -Wl,--as-needed

$(LIB)/test/libgpushare-asan.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) $(ASAN) $(BASEFLAGS) -o $@ $(GS_SRC) $(GS_SO) $(GS_LIBS)

# dispatch.c (our dlsym) runs while the TSan runtime itself starts up (its interceptors call
# dlsym), before TSan can record anything: it is built uninstrumented in the TSan variant.
$(LIB)/test/libgpushare-tsan.so: $(GS_SRC) $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O1 -g $(BASEFLAGS) -c -o $(LIB)/test/dispatch-tsan.o $(GS_DIR)/dispatch.c
	$(CC) $(TSAN) $(BASEFLAGS) -o $@ $(LIB)/test/dispatch-tsan.o \
	    $(filter-out $(GS_DIR)/dispatch.c,$(GS_SRC)) $(GS_SO) $(GS_LIBS)

$(LIB)/test/gs_tenant: $(GS_TESTS)/gs_tenant.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O2 -g $(BASEFLAGS) -o $@ $< $(GS_LIBS)

$(LIB)/test/gs_tenant-asan: $(GS_TESTS)/gs_tenant.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) $(ASAN) $(BASEFLAGS) -o $@ $< $(GS_LIBS)

$(LIB)/test/gs_tenant-tsan: $(GS_TESTS)/gs_tenant.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) $(TSAN) $(BASEFLAGS) -o $@ $< $(GS_LIBS)

$(LIB)/test/gs_fastpath: $(GS_TESTS)/gs_fastpath.c $(GS_HDR)
	@mkdir -p $(LIB)/test
	$(CC) -O2 $(BASEFLAGS) -I$(GS_DIR) -o $@ $<

.PHONY: interposer-tests
interposer-tests: $(LIB)/libgpushare.so $(LIB)/test/gs_tenant $(LIB)/test/gs_fastpath $(LIB)/test/gs_tenant-asan \
	$(LIB)/test/gs_tenant-tsan $(LIB)/test/libgpushare-asan.so $(LIB)/test/libgpushare-tsan.so
