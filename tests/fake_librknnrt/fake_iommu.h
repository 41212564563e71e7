/* The NPU driver's IOMMU domains as the fake librknnrt models them (fake_iommu.c); the matmul
 * entry points (fake_rknnrt.c) call these where the driver would be entered. */
#ifndef FAKE_IOMMU_H
#define FAKE_IOMMU_H

#include <stdint.h>

/* rknpu_drv.h: RKNPU_MAX_IOMMU_DOMAIN_NUM 16 (the ids the driver accepts: 0..15) */
#define FAKE_DOMAINS 16

/* Take a reference on `domain`, switching the NPU to it if nothing is outstanding in the current
 * one, else waiting for that; 0, or -1 when the wait times out (the driver's -EINVAL). */
int fake_domain_get(int domain);
/* Drop the reference fake_domain_get took. */
void fake_domain_put(void);
/* Reserve `size` bytes, page-rounded, in `domain`'s 4 GiB; 0, or -1 when the domain is full. */
int fake_domain_reserve(int domain, uint32_t size);
/* Give back what fake_domain_reserve(domain, size) took. */
void fake_domain_release(int domain, uint32_t size);
/* Block while the test holds runs (fake_hold_runs), counted as held meanwhile. */
void fake_run_gate(void);

#endif
