/* product.c - what each simulated product is, as its real counterpart reports it through NVML and
 * the driver: compute capability, power, clocks, PCIe and NVLink, and which features exist.
 *
 * Figures are those of the real boards (NVIDIA data sheets and `nvidia-smi -q` on the product);
 * the simulator only needs them to answer queries the way the real driver would, so that tools
 * written for real GPUs (nvitop, gpustat, DCGM-style collectors) see a plausible device. The
 * product is found by a substring of the NVML name (inventory.SIMULATED_PRODUCTS); an unknown
 * name gets a generic Ampere data-centre part.
 */
#include <string.h>

#include "sim_state.h"

/* clang-format off */
static const struct sim_product products[] = {
    /* key, cc, arch, brand, TDP/idle/min W, boost clocks {gfx, SM, mem, video}, idle clocks,
     * PCIe gen/width, NVLinks/version/MB/s, bus width, cores/SM, BAR1 MiB, temps slowdown/
     * shutdown/GPU max/memory max, MIG slices, HBM, row remapping, PCI id */
    {"H200", 9, 0, SIM_ARCH_HOPPER, SIM_BRAND_NVIDIA, 700, 75, 200, {1980, 1980, 3201, 1755},
     {345, 345, 3201, 1110}, 5, 16, 18, 4, 26562, 6144, 128, 262144, 90, 95, 87, 95, 7, 1, 1,
     0x233510DE},
    {"H100", 9, 0, SIM_ARCH_HOPPER, SIM_BRAND_NVIDIA, 700, 70, 200, {1980, 1980, 2619, 1755},
     {345, 345, 2619, 1110}, 5, 16, 18, 4, 26562, 5120, 128, 131072, 90, 95, 87, 95, 7, 1, 1,
     0x233010DE},
    {"A100", 8, 0, SIM_ARCH_AMPERE, SIM_BRAND_NVIDIA, 400, 60, 100, {1410, 1410, 1593, 1275},
     {210, 210, 1593, 795}, 4, 16, 12, 3, 25781, 5120, 64, 131072, 92, 95, 88, 95, 7, 1, 1,
     0x20B210DE},
    {"A10", 8, 6, SIM_ARCH_AMPERE, SIM_BRAND_NVIDIA, 150, 20, 100, {1695, 1695, 6251, 1500},
     {210, 210, 405, 555}, 4, 16, 0, 0, 0, 384, 128, 32768, 95, 98, 91, 0, 0, 0, 1,
     0x223610DE},
    {"L4", 8, 9, SIM_ARCH_ADA, SIM_BRAND_NVIDIA, 72, 16, 40, {2040, 2040, 6251, 1770},
     {210, 210, 405, 795}, 4, 16, 0, 0, 0, 192, 128, 32768, 92, 97, 89, 0, 0, 0, 1, 0x27B810DE},
    {"T4", 7, 5, SIM_ARCH_TURING, SIM_BRAND_NVIDIA, 70, 10, 60, {1590, 1590, 5001, 1470},
     {300, 300, 405, 540}, 3, 16, 0, 0, 0, 256, 64, 256, 94, 96, 87, 0, 0, 0, 0, 0x1EB810DE},
    {"V100", 7, 0, SIM_ARCH_VOLTA, SIM_BRAND_TESLA, 300, 40, 150, {1530, 1530, 877, 1372},
     {135, 135, 877, 555}, 3, 16, 6, 2, 25781, 4096, 64, 32768, 87, 90, 83, 85, 0, 1, 0,
     0x1DB510DE},
};
static const struct sim_product generic = {
    "", 8, 0, SIM_ARCH_AMPERE, SIM_BRAND_NVIDIA, 300, 50, 100, {1410, 1410, 1593, 1275},
    {210, 210, 1593, 795}, 4, 16, 0, 0, 0, 5120, 64, 65536, 92, 95, 88, 95, 0, 1, 1, 0x20B510DE};
/* clang-format on */

const struct sim_product *sim_product_of(const char *name) {
    for (size_t i = 0; i < sizeof products / sizeof products[0]; i++)
        if (name && strstr(name, products[i].key)) return &products[i];
    return &generic;
}

void sim_product(const char *name, int *cc_major, int *cc_minor, unsigned *tdp_watts) {
    const struct sim_product *p = sim_product_of(name);
    *cc_major = p->cc_major;
    *cc_minor = p->cc_minor;
    *tdp_watts = p->tdp_w;
}
