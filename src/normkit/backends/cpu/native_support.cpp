// What normkit's C++ executor (native.cpp) does to tensors beside running kernels: their
// layout (rows of channels; a gradient laid out as the input), the memory of its outputs
// (whether a page is resident, huge-page advice) and BatchNorm's running buffers, updated
// in place. A second source of the same extension (native.py builds both), so that
// each file keeps one concern.
#include <ATen/ATen.h>   // (not <torch/extension.h>: this file needs ATen alone; 9 s, not 29)

#include <ATen/OpMathType.h>

#include <sys/mman.h>
#include <unistd.h>

namespace normkit_native {

using Tensor = at::Tensor;

// whether x's memory is N rows of S positions of C channels, dense, the channels adjacent
// (channels_last, a contiguous (N, C), or a view that splits the channels into groups):
// dims 1.. hold the C channels and then the S positions, dim 0 the N samples
bool rows_of_channels(const Tensor& x, int64_t n, int64_t c, int64_t s) {
  int64_t d = 1, dims = x.dim(), channels = 1;
  while (d < dims && channels < c) channels *= x.size(d++);
  if (dims < 2 || channels != c || x.size(0) != n) return false;
  int64_t expected = 1;
  for (int64_t i = d - 1; i >= 1; --i) {                  // the channels: stride 1 up
    if (x.size(i) != 1 && x.stride(i) != expected) return false;
    expected *= x.size(i);
  }
  int64_t positions = 1;
  for (int64_t i = dims - 1; i >= d; --i) {               // the positions: C apart
    if (x.size(i) != 1 && x.stride(i) != expected) return false;
    expected *= x.size(i), positions *= x.size(i);
  }
  return positions == s && (n == 1 || x.stride(0) == expected);
}

// the incoming gradient laid out as x (whose layout the plan's kernels read)
Tensor like_input(const Tensor& grad, const Tensor& x) {
  if (grad.strides() == x.strides()) return grad;
  return at::empty_like(x).copy_(grad);
}

// glibc's new mappings fault in zeroed pages; streaming stores pay only where the memory
// is already there (tuning.stream_out): the last page, as _memory.resident asks
bool resident(const Tensor& t) {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t nbytes = t.numel() * t.element_size();
  if (nbytes == 0) return false;
  uintptr_t last = (reinterpret_cast<uintptr_t>(t.data_ptr()) + nbytes - 1) / page * page;
  unsigned char vec = 0;
  return mincore(reinterpret_cast<void*>(last), page, &vec) == 0 && (vec & 1);
}

// the 2 MiB-aligned interior of t's memory, (start, bytes) (bytes 0: none)
std::pair<int64_t, int64_t> huge_interior(const Tensor& t) {
  constexpr uintptr_t huge = 1 << 21;
  uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr());
  uintptr_t lo = (start + huge - 1) / huge * huge;
  uintptr_t hi = (start + t.numel() * t.element_size()) / huge * huge;
  return {static_cast<int64_t>(lo), hi > lo ? static_cast<int64_t>(hi - lo) : 0};
}

// a large new output's interior advised MADV_HUGEPAGE (_memory: NORMKIT_HUGE_PAGES=1)
void advise_huge(const Tensor& t) {
  auto [lo, bytes] = huge_interior(t);
  if (bytes > 0) madvise(reinterpret_cast<void*>(lo), bytes, MADV_HUGEPAGE);
}

// BatchNorm's running statistics in place (the same operations in the same order as
// normkit.backends.torch_ops.update_running: each in the buffers' dtype T, computed in its
// opmath type O as torch's ops compute it -- float for bfloat16 and float16 -- and rounded;
// the statistics S (float, or double for double buffers) unbiased in their own dtype):
//   running_mean = running_mean * (1 - momentum) + momentum * mean
//   running_var  = running_var * (1 - momentum) + momentum * (var * unbias)
template <typename T, typename S>
void update_running_loop(T* running_mean, T* running_var, const S* mean, const S* var,
                         int64_t c, double momentum, double unbias) {
  using O = at::opmath_type<T>;
  // (torch's in-place multiply by a number rounds the number to T first; the out-of-place
  // one takes it in O)
  const O keep = static_cast<O>(static_cast<T>(1.0 - momentum)), m = static_cast<O>(momentum);
  const S u = static_cast<S>(unbias);
  auto step = [&](T& running, S value) {
    T kept = static_cast<T>(static_cast<O>(running) * keep);
    T added = static_cast<T>(m * static_cast<O>(static_cast<T>(value)));
    running = static_cast<T>(static_cast<O>(kept) + static_cast<O>(added));
  };
  for (int64_t i = 0; i < c; ++i) {
    step(running_mean[i], mean[i]);
    step(running_var[i], var[i] * u);
  }
}

// false: not handled here (another dtype, device or layout; the caller's path runs)
bool update_running(Tensor& running_mean, Tensor& running_var, const Tensor& mean,
                    const Tensor& var, double momentum, double unbias) {
  auto dtype = running_mean.scalar_type(), sdtype = mean.scalar_type();
  int64_t c = running_mean.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&running_mean, &running_var,
                                                                &mean, &var})
    if (!t->device().is_cpu() || !t->is_contiguous() || t->numel() != c) return false;
  if (running_var.scalar_type() != dtype || var.scalar_type() != sdtype) return false;
  if (dtype == at::kDouble && sdtype == at::kDouble)
    update_running_loop(running_mean.data_ptr<double>(), running_var.data_ptr<double>(),
                        mean.data_ptr<double>(), var.data_ptr<double>(), c, momentum, unbias);
  else if (sdtype != at::kFloat)
    return false;
  else if (dtype == at::kFloat)
    update_running_loop(running_mean.data_ptr<float>(), running_var.data_ptr<float>(),
                        mean.data_ptr<float>(), var.data_ptr<float>(), c, momentum, unbias);
  else if (dtype == at::kBFloat16)
    update_running_loop(running_mean.data_ptr<at::BFloat16>(),
                        running_var.data_ptr<at::BFloat16>(), mean.data_ptr<float>(),
                        var.data_ptr<float>(), c, momentum, unbias);
  else if (dtype == at::kHalf)
    update_running_loop(running_mean.data_ptr<at::Half>(), running_var.data_ptr<at::Half>(),
                        mean.data_ptr<float>(), var.data_ptr<float>(), c, momentum, unbias);
  else
    return false;
  running_mean.unsafeGetTensorImpl()->bump_version();
  running_var.unsafeGetTensorImpl()->bump_version();
  return true;
}

}  // namespace normkit_native
