#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define NANFREE_EMULATION_ASAN 1
#endif

namespace cuda_emulation {
namespace {

// Kernel threads need little stack (a few KB of locals); AddressSanitizer's
// redzones need more.
#if defined(NANFREE_EMULATION_ASAN)
constexpr size_t kStackBytes = 1 << 20;
#else
constexpr size_t kStackBytes = 256 << 10;
#endif

// The fiber the running one was entered from (AddressSanitizer learns the
// OS thread's own stack bounds from the first switch away from it).
thread_local Fiber* previous_fiber = nullptr;

}  // namespace

#if defined(__x86_64__)
// void nanfree_emulation_switch(void** save_sp, void* load_sp): saves the
// callee-saved registers, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *save_sp, and resumes the context saved at load_sp.
// A new fiber's stack is laid out by prepare() so that the resume "returns"
// into nanfree_emulation_start with the entry in r13 and its argument in r12.
extern "C" void nanfree_emulation_switch(void** save_sp, void* load_sp);
extern "C" void nanfree_emulation_start();
asm(R"(
    .text
    .globl nanfree_emulation_switch
    .hidden nanfree_emulation_switch
    .type nanfree_emulation_switch, @function
nanfree_emulation_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size nanfree_emulation_switch, .-nanfree_emulation_switch

    .globl nanfree_emulation_start
    .hidden nanfree_emulation_start
    .type nanfree_emulation_start, @function
nanfree_emulation_start:
    andq $-16, %rsp
    movq %r12, %rdi
    callq *%r13
    ud2
    .size nanfree_emulation_start, .-nanfree_emulation_start
)");
#else
void Fiber::start_from_ucontext(unsigned lo, unsigned hi) {
  const uintptr_t bits = (static_cast<uintptr_t>(hi) << 32) | lo;
  Fiber* fiber = reinterpret_cast<Fiber*>(bits);
  fiber->entry_(fiber->arg_);
  std::abort();  // an entry never returns: it switches away for good
}
#endif

Fiber::~Fiber() {
  if (stack_ != nullptr) munmap(stack_, mapped_);
}

void Fiber::allocate() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  mapped_ = kStackBytes + page;
  void* mapping = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) {
    std::fprintf(stderr, "cuda emulation: cannot map a fiber stack of %zu bytes\n", mapped_);
    std::abort();
  }
  // The lowest page stays inaccessible: a stack overflow faults instead of
  // writing over the neighbouring stack.
  mprotect(mapping, page, PROT_NONE);
  stack_ = mapping;
  stack_bottom_ = static_cast<char*>(mapping) + page;
  stack_size_ = kStackBytes;
}

void Fiber::prepare(Entry entry, void* arg) {
  if (stack_ == nullptr) allocate();
#if defined(NANFREE_EMULATION_ASAN)
  // A kernel thread that ran here before returned from the kernel, but not
  // from the entry function that switched away for good: the redzones of
  // those few top frames are still poisoned.
  constexpr size_t kTopFrames = 64 << 10;
  ASAN_UNPOISON_MEMORY_REGION(static_cast<const char*>(stack_bottom_) + stack_size_ - kTopFrames,
                              kTopFrames);
#endif
  char* top = static_cast<char*>(const_cast<void*>(stack_bottom_)) + stack_size_;
#if defined(__x86_64__)
  uintptr_t* sp = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
  *--sp = 0;                                                   // no return address
  *--sp = reinterpret_cast<uintptr_t>(&nanfree_emulation_start);  // where the resume "returns"
  *--sp = 0;                                                   // rbp
  *--sp = 0;                                                   // rbx
  *--sp = reinterpret_cast<uintptr_t>(arg);                    // r12
  *--sp = reinterpret_cast<uintptr_t>(entry);                  // r13
  *--sp = 0;                                                   // r14
  *--sp = 0;                                                   // r15
  // MXCSR (all exceptions masked, round to nearest) and the x87 control word
  // (extended precision, all exceptions masked): the defaults of a new thread.
  *--sp = (uintptr_t(0x037F) << 32) | 0x1F80;
  sp_ = sp;
#else
  entry_ = entry;
  arg_ = arg;
  getcontext(&context_);
  context_.uc_stack.ss_sp = const_cast<void*>(stack_bottom_);
  context_.uc_stack.ss_size = stack_size_;
  context_.uc_link = nullptr;
  const uintptr_t bits = reinterpret_cast<uintptr_t>(this);
  makecontext(&context_, reinterpret_cast<void (*)()>(&start_from_ucontext), 2,
              static_cast<unsigned>(bits & 0xffffffffu), static_cast<unsigned>(bits >> 32));
#endif
}

void Fiber::switch_from(Fiber& from) {
  previous_fiber = &from;
#if defined(NANFREE_EMULATION_ASAN)
  __sanitizer_start_switch_fiber(&from.asan_fake_stack_, stack_bottom_, stack_size_);
#endif
#if defined(__x86_64__)
  nanfree_emulation_switch(&from.sp_, sp_);
#else
  swapcontext(&from.context_, &context_);
#endif
  // Running `from` again: someone switched back to it.
#if defined(NANFREE_EMULATION_ASAN)
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(from.asan_fake_stack_, &bottom, &size);
  previous_fiber->stack_bottom_ = bottom;
  previous_fiber->stack_size_ = size;
#endif
}

void Fiber::entered() {
#if defined(NANFREE_EMULATION_ASAN)
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
  previous_fiber->stack_bottom_ = bottom;
  previous_fiber->stack_size_ = size;
#endif
}

}  // namespace cuda_emulation
