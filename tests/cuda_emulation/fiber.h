// Fibers for the CUDA emulation: one stack and saved context per CUDA
// thread, switched cooperatively on one OS thread. x86-64 switches with a few
// instructions (callee-saved registers, the stack pointer, MXCSR and the x87
// control word); other machines use ucontext. Under AddressSanitizer every
// switch is announced to it (__sanitizer_start/finish_switch_fiber) and a
// reused stack is unpoisoned first.
#pragma once

#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_emulation {

class Fiber {
 public:
  using Entry = void (*)(void* arg);

  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber();

  // Makes the next switch_to() start entry(arg) on this fiber's stack (a
  // fresh start: whatever ran there before is forgotten).
  void prepare(Entry entry, void* arg);

  // Saves the running context into `from` and continues this fiber.
  void switch_from(Fiber& from);

  // The first thing an entry function calls (tells AddressSanitizer the switch is done).
  static void entered();

 private:
  void allocate();

  void* stack_ = nullptr;   // lowest address of the mapping (a guard page)
  size_t mapped_ = 0;       // bytes mapped, guard page included
#if defined(__x86_64__)
  void* sp_ = nullptr;      // saved stack pointer while not running
#else
  static void start_from_ucontext(unsigned lo, unsigned hi);
  ucontext_t context_{};
  Entry entry_ = nullptr;
  void* arg_ = nullptr;
#endif
  // AddressSanitizer's bookkeeping of this fiber's stack.
  void* asan_fake_stack_ = nullptr;
  const void* stack_bottom_ = nullptr;
  size_t stack_size_ = 0;
};

}  // namespace cuda_emulation
