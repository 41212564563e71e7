/* The fake librknnrt's version query, cache sync and misbehaving builds (fake_misbehave.c). */
#ifndef FAKE_MISBEHAVE_H
#define FAKE_MISBEHAVE_H

#include <stddef.h>
#include <stdint.h>

/* the NPU's own copy of a new buffer of `size` bytes (the stale-cache build), else NULL */
void *fake_device_copy(uint32_t size);
/* binding A: the library flushes the CPU's view to the NPU's (no-op when dev is NULL) */
void fake_bind_flush(void *dev, const void *virt, uint32_t size);
/* around a run: whether it raced (the racing build); after it, the run's end and the damage to C */
int fake_race_enter(void);
void fake_misbehave_product(int32_t *C, int M, int raced);

#endif
