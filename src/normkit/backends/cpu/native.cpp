// normkit's small-call path in C++: a normalization as a torch::autograd::Function whose
// forward and backward allocate with ATen and run normkit's numba kernels, compiled as
// C callbacks (numba cfuncs, see native.py) and called through their addresses.
//
// Why: on a small tensor a call's cost is the Python around the kernel, most of it the
// Python autograd.Function (docs/performance.md, "A C++ autograd node, measured"). Here the
// node, the allocation and the launch cost what torch's own ops cost.
//
// A Plan holds what native.py decided once per shape (plans.py's plan of the same input):
// the two kernels and their constant arguments, the statistics' shape and dtype, the
// defaults for a missing weight or bias, and the grouping, for the double backward.
//
// Kernel arguments, an int64 array (and eps, a double):
//   forward:  x, y, w, b, mean, rstd, var, from_var, <forward constants>
//   backward: g, x, dx, w, mean, rstd, dw, db, <backward constants>
// (addresses of contiguous memory; a statistics address 0: the kernel's own scratch;
// from_var: the fixed statistics are a mean and a variance, rstd computed in the kernel),
// and in the last four slots: the stage of a staged family (stages 0, 1, 2: columns.py),
// the address of a threaded backward's partial sums or a staged family's scratch (0:
// none), and the range [lo, hi) of work items the call covers.
//
// A plan of several threads splits the work items into contiguous ranges, as the Python
// plan's launch does (the same ranges), and runs them in a parallel region of torch's own
// OpenMP runtime (GOMP_parallel, its address handed over by native.py from _parallel.py),
// with no Python callback per thread. (at::parallel_for is no use here: its OpenMP region
// is a pragma in a header, which would bind this extension to a second OpenMP runtime.)
// Its backward writes per-range partial sums of the parameter gradients, added up here
// after the threads:
//   rows:   dw, db partials (chunks, K), summed over the chunks with at::sum;
//   planes: (2, N, C) per-plane sums, added over n in float64 in order (entries.param_sums).
// The staged families (columns: BatchNorm on channels_last and (N, C); channels_last:
// Instance/GroupNorm) run every call in stages instead, each a kernel call of its own over
// its work items (run_stages): their partial sums, merged on one thread in stage 1, live
// in the node's scratch. (Instance/GroupNorm's forward with a sample per thread or more
// is stage 0 alone: a sample's statistics, then the sample, per work item.)
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <pthread.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
using Tensor = at::Tensor;

typedef void (*kernel_fn)(int64_t*, double);

constexpr int kAddresses = 8;   // slots before the constants, either direction
constexpr int kMaxArgs = 24;
constexpr int kStage = kMaxArgs - 4, kSums = kMaxArgs - 3, kLo = kMaxArgs - 2,
              kHi = kMaxArgs - 1;

// how a threaded backward leaves its parameter gradients; kStaged: a staged family
// (columns, channels_last), whose every call runs in stages (scratch in a[kSums])
enum Partials : int64_t { kNone = 0, kRowChunks = 1, kPlaneSums = 2, kStaged = 3 };

// torch's OpenMP runtime (set_team; none after a fork: GNU OpenMP is not fork-safe)
typedef void (*region_fn)(void*);
void (*gomp_parallel)(region_fn, void*, unsigned, unsigned) = nullptr;
int (*omp_thread_num)() = nullptr;
int (*omp_num_threads)() = nullptr;

void forget_team() {
  gomp_parallel = nullptr, omp_thread_num = nullptr, omp_num_threads = nullptr;
}

void set_team(int64_t parallel, int64_t thread_num, int64_t num_threads) {
  static bool registered = false;
  if (!registered) pthread_atfork(nullptr, nullptr, forget_team), registered = true;
  gomp_parallel = reinterpret_cast<void (*)(region_fn, void*, unsigned, unsigned)>(parallel);
  omp_thread_num = reinterpret_cast<int (*)()>(thread_num);
  omp_num_threads = reinterpret_cast<int (*)()>(num_threads);
}

// one parallel region's work: `ranges` contiguous ranges of `step` items out of `units`
struct Region {
  kernel_fn kernel;
  const int64_t* args;
  double eps;
  int64_t units, step, ranges;

  void range(int64_t r) const {
    int64_t own[kMaxArgs];
    std::copy(args, args + kMaxArgs, own);
    own[kLo] = r * step, own[kHi] = std::min(units, (r + 1) * step);
    kernel(own, eps);
  }

  // each member of the team: its ranges (all of them, in a smaller team than asked for)
  static void member(void* data) {
    const Region& job = *static_cast<const Region*>(data);
    int64_t tid = omp_thread_num(), team = omp_num_threads();
    for (int64_t r = tid; r < job.ranges; r += team) job.range(r);
  }
};

struct Plan : torch::CustomClassHolder {
  kernel_fn forward_kernel = nullptr, backward_kernel = nullptr;
  std::vector<int64_t> forward_consts, backward_consts, stat_shape;
  Tensor ones, zeros;           // weight, bias when None: (params,) of the statistics dtype
  bool zero_grads = false;      // the backward kernel adds into dw, db (rows): zero them
  // the grouping, as torch.ops.normkit.norm_backward takes it (double backward)
  std::string kind;
  std::vector<int64_t> view, reduce;
  c10::optional<std::vector<int64_t>> param_view;
  bool center = true;
  at::ScalarType dtype = at::kFloat;   // the input's, and its number of elements
  int64_t numel = 0;
  int64_t stat_count = 1;              // elements of stat_shape
  // work items of each kernel, the threads they are split over, and how a threaded
  // backward leaves its parameter gradients (Partials; partial_rows: chunks, or N)
  int64_t forward_units = 1, backward_units = 1, threads = 1;
  int64_t partials = kNone, partial_rows = 0;
  int64_t stage_units = 0;      // a staged plan's work items in stage 0 (backward)
  int64_t forward_stage_units = 0;   // (forward)

  at::ScalarType sdtype() const { return ones.scalar_type(); }

  // a weight or bias as contiguous memory of the statistics dtype; one of another size or
  // device is refused (a caller that keeps the plan across calls may pass one)
  Tensor param(const Tensor& p, const Tensor& fallback) const {
    if (!p.defined()) return fallback;
    TORCH_CHECK(p.numel() == ones.numel() && p.device().is_cpu(),
                "normkit native plan: a weight or bias of ", ones.numel(), " elements on the "
                "CPU, got sizes ", p.sizes(), " on ", p.device());
    if (p.scalar_type() != sdtype() || !p.is_contiguous())
      return p.detach().to(sdtype()).contiguous();
    return p;
  }

  // given statistics (fixed or saved) the same way: one per group, or one per channel
  // (running statistics)
  Tensor stat(const Tensor& t) const {
    TORCH_CHECK((t.numel() == stat_count || t.numel() == ones.numel()) && t.device().is_cpu(),
                "normkit native plan: statistics of ", stat_count, " (or ", ones.numel(),
                ") elements on the CPU, got sizes ", t.sizes(), " on ", t.device());
    if (t.scalar_type() != sdtype() || !t.is_contiguous()) return t.to(sdtype()).contiguous();
    return t;
  }

  // a kernel's argument array: the addresses, then the plan's constants
  void args(int64_t* a, std::initializer_list<int64_t> addresses,
            const std::vector<int64_t>& consts) const {
    int64_t i = 0;
    for (int64_t v : addresses) a[i++] = v;
    for (int64_t v : consts) a[i++] = v;
    a[kSums] = 0, a[kStage] = 0;
  }

  // the kernel over [0, units): on this thread, or in min(threads, units) contiguous
  // ranges on torch's team (each with its own copy of the arguments; one after the other
  // where there is no team, after a fork)
  void run(kernel_fn kernel, int64_t* a, double eps, int64_t units) const {
    int64_t n = std::min(threads, units);
    if (n <= 1) {
      a[kLo] = 0, a[kHi] = units;
      kernel(a, eps);
      return;
    }
    int64_t step = (units + n - 1) / n;
    Region job{kernel, a, eps, units, step, (units + step - 1) / step};
    if (gomp_parallel == nullptr) {
      for (int64_t r = 0; r < job.ranges; ++r) job.range(r);
      return;
    }
    if (PyGILState_Check()) {   // as torch's ops: other Python threads run meanwhile, and
      py::gil_scoped_release no_gil;   // a kernel's error report (numba) can take the GIL
      gomp_parallel(&Region::member, &job, static_cast<unsigned>(job.ranges), 0);
    } else {                    // (a backward on autograd's thread holds no GIL)
      gomp_parallel(&Region::member, &job, static_cast<unsigned>(job.ranges), 0);
    }
  }

  bool threaded_backward() const { return threads > 1 && backward_units > 1; }

  bool staged() const { return partials == kStaged; }

  // a staged family's scratch: (2, partial_rows, params) float64
  Tensor stage_sums() const {
    return at::empty({2, partial_rows, ones.numel()}, ones.options().dtype(at::kDouble));
  }

  // stages 0 (over `first` items), 1 (one call, on this thread) and 2 (over `units`);
  // units 0: stage 0 is the whole call (channels_last forward, a sample per item)
  void run_stages(kernel_fn kernel, int64_t* a, double eps, int64_t first,
                  int64_t units) const {
    a[kStage] = 0;
    run(kernel, a, eps, first);
    if (units == 0) return;
    a[kStage] = 1, a[kLo] = 0, a[kHi] = 1;
    kernel(a, eps);
    a[kStage] = 2;
    run(kernel, a, eps, units);
  }
};

// dbias, dweight (C,) from a threaded planes backward's (2, N, C) sums: each added over n
// in float64, in order, and rounded once (as entries.param_sums)
template <typename T>
void sum_planes(const T* sums, T* db, T* dw, int64_t n, int64_t c) {
  for (int64_t ch = 0; ch < c; ++ch) {
    double sg = 0.0, sgx = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      sg += static_cast<double>(sums[i * c + ch]);
      sgx += static_cast<double>(sums[(n + i) * c + ch]);
    }
    db[ch] = static_cast<T>(sg);
    dw[ch] = static_cast<T>(sgx);
  }
}

int64_t address(const Tensor& t) {
  return t.defined() ? reinterpret_cast<int64_t>(t.data_ptr()) : 0;
}

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

// the kernels trust the plan's sizes, dtype and memory layout (contiguous; rows of
// channels for a staged plan: columns, channels_last): a tensor of another is refused here
void check_input(const Plan& p, const Tensor& x) {
  bool layout = p.staged() ? rows_of_channels(x, p.view.front(), p.numel / (p.view.front() *
                                                                       p.view.back()),
                                               p.view.back())
                            : x.is_contiguous();
  TORCH_CHECK(layout && x.device().is_cpu() && x.scalar_type() == p.dtype &&
                  x.numel() == p.numel,
              "normkit native plan: built for a ",
              p.staged() ? "channels_last (rows of channels)" : "contiguous", " CPU tensor of ",
              p.numel, " ", c10::toString(p.dtype), " elements, got sizes ", x.sizes(),
              ", strides ", x.strides(), ", ", c10::toString(x.scalar_type()), "; take the "
              "plan of this input from normkit.backends.plan");
}

// the incoming gradient laid out as x (whose layout the plan's kernels read)
Tensor like_input(const Tensor& grad, const Tensor& x) {
  if (grad.strides() == x.strides()) return grad;
  return at::empty_like(x).copy_(grad);
}

// BatchNorm's running statistics in place, as normkit.backends.cpu.running does it (the
// same operations in the same order, in the buffers' dtype):
//   running_mean = running_mean * (1 - momentum) + momentum * mean
//   running_var  = running_var * (1 - momentum) + momentum * (var * unbias)
template <typename T>
void update_running_loop(T* running_mean, T* running_var, const T* mean, const T* var,
                         int64_t c, double momentum, double unbias) {
  const T keep = static_cast<T>(1.0 - momentum), m = static_cast<T>(momentum);
  const T u = static_cast<T>(unbias);
  for (int64_t i = 0; i < c; ++i) {
    T unbiased = var[i] * u;
    running_mean[i] *= keep;
    running_mean[i] += m * mean[i];
    running_var[i] *= keep;
    running_var[i] += m * unbiased;
  }
}

// false: not handled here (another dtype, device or layout; the caller's path runs)
bool update_running(Tensor& running_mean, Tensor& running_var, const Tensor& mean,
                    const Tensor& var, double momentum, double unbias) {
  auto dtype = running_mean.scalar_type();
  int64_t c = running_mean.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&running_mean, &running_var,
                                                                &mean, &var})
    if (t->scalar_type() != dtype || !t->device().is_cpu() || !t->is_contiguous() ||
        t->numel() != c)
      return false;
  if (dtype == at::kFloat)
    update_running_loop(running_mean.data_ptr<float>(), running_var.data_ptr<float>(),
                        mean.data_ptr<float>(), var.data_ptr<float>(), c, momentum, unbias);
  else if (dtype == at::kDouble)
    update_running_loop(running_mean.data_ptr<double>(), running_var.data_ptr<double>(),
                        mean.data_ptr<double>(), var.data_ptr<double>(), c, momentum, unbias);
  else
    return false;
  running_mean.unsafeGetTensorImpl()->bump_version();
  running_var.unsafeGetTensorImpl()->bump_version();
  return true;
}

// the running statistics a BatchNorm call in training updates after its kernel
struct Running {
  Tensor mean, var;           // undefined: none
  double momentum = 0.0, unbias = 1.0;

  // updated here: true; false: the caller updates them from the returned statistics
  bool update(const Tensor& batch_mean, const Tensor& batch_var) {
    return mean.defined() && update_running(mean, var, batch_mean, batch_var, momentum, unbias);
  }
};

// y (and the statistics, unless fixed or not kept) of one forward call. Fixed statistics:
// fixed_mean and fixed (the rstd, or the variance with from_var).
tensor_list run_forward(const Plan& p, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps, const Tensor& fixed_mean, const Tensor& fixed,
                        bool from_var, bool keep_stats, Running running) {
  check_input(p, x);
  Tensor y = at::empty_like(x);
  Tensor wk = p.param(w, p.ones), bk = p.param(b, p.zeros);
  Tensor mean, rstd, var;
  if (fixed_mean.defined()) {
    mean = p.stat(fixed_mean);
    rstd = p.stat(fixed);
  } else if (keep_stats || p.staged()) {      // (a staged forward's stage 2 reads them)
    auto options = x.options().dtype(p.sdtype());
    mean = at::empty(p.stat_shape, options);
    rstd = at::empty(p.stat_shape, options);
    var = at::empty(p.stat_shape, options);
  }
  int64_t a[kMaxArgs];
  p.args(a, {address(x), address(y), address(wk), address(bk), address(mean), address(rstd),
             fixed_mean.defined() ? address(mean) : address(var), from_var ? 1 : 0},
         p.forward_consts);
  if (!p.staged()) {
    p.run(p.forward_kernel, a, eps, p.forward_units);
  } else if (fixed_mean.defined()) {          // given statistics: stage 2 alone
    a[kStage] = 2;
    p.run(p.forward_kernel, a, eps, p.forward_units);
  } else {
    Tensor sums = p.stage_sums();
    a[kSums] = address(sums);
    p.run_stages(p.forward_kernel, a, eps, p.forward_stage_units, p.forward_units);
  }
  if (fixed_mean.defined() || !keep_stats || running.update(mean, var)) return {y};
  return {y, mean, rstd, var};
}

Tensor optional(const c10::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

tensor_list backward_op(const Plan& p, const Tensor& g, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, double eps, bool fixed,
                        std::array<bool, 3> needs);

// (dx, dweight, dbias) of one backward call, the parameter gradients (params,) of the
// statistics dtype
tensor_list run_backward(const Plan& p, const Tensor& grad, const Tensor& x, const Tensor& w,
                         const Tensor& mean, const Tensor& rstd) {
  check_input(p, x);
  Tensor g = like_input(grad.sizes() == x.sizes() ? grad : grad.reshape(x.sizes()), x);
  Tensor dx = at::empty_like(x);
  auto options = x.options().dtype(p.sdtype());
  int64_t params = p.ones.numel();
  Tensor wk = p.param(w, p.ones), ms = p.stat(mean), rs = p.stat(rstd);
  // the kernel's dw, db: (params,), or a threaded rows backward's (chunks, params) partials
  // (summed below); a threaded planes backward writes (2, N, C) sums instead
  bool chunks = p.threaded_backward() && p.partials == kRowChunks;
  bool plane_sums = p.threaded_backward() && p.partials == kPlaneSums;
  std::vector<int64_t> shape = chunks ? std::vector<int64_t>{p.partial_rows, params}
                                      : std::vector<int64_t>{params};
  bool zero = chunks || p.zero_grads;
  Tensor dw = zero ? at::zeros(shape, options) : at::empty(shape, options);
  Tensor db = zero ? at::zeros(shape, options) : at::empty(shape, options);
  Tensor sums = plane_sums ? at::empty({2, p.partial_rows, params}, options)
                : p.staged() ? p.stage_sums() : Tensor();
  int64_t a[kMaxArgs];
  p.args(a, {address(g), address(x), address(dx), address(wk), address(ms), address(rs),
             plane_sums ? 0 : address(dw), plane_sums ? 0 : address(db)},
         p.backward_consts);
  a[kSums] = address(sums);
  if (p.staged())
    p.run_stages(p.backward_kernel, a, 0.0, p.stage_units, p.backward_units);
  else
    p.run(p.backward_kernel, a, 0.0, p.backward_units);
  if (chunks) return {dx, dw.sum(0), db.sum(0)};
  if (plane_sums) {
    if (p.sdtype() == at::kDouble)
      sum_planes(sums.data_ptr<double>(), db.data_ptr<double>(), dw.data_ptr<double>(),
                 p.partial_rows, params);
    else
      sum_planes(sums.data_ptr<float>(), db.data_ptr<float>(), dw.data_ptr<float>(),
                 p.partial_rows, params);
  }
  return {dx, dw, db};
}

// what a node keeps besides its saved tensors: one capsule under one key (each key of
// the context's map costs a string and a hash per call)
struct Kept : torch::CustomClassHolder {
  c10::intrusive_ptr<Plan> plan;
  double eps = 0.0;
  bool fixed = false, has_bias = false;
  std::vector<int64_t> bias_shape;
  at::ScalarType bias_dtype = at::kFloat;
};

// a gradient in its parameter's shape and dtype (no new tensor where it already is)
Tensor as_param(const Tensor& grad, at::IntArrayRef shape, at::ScalarType dtype) {
  Tensor out = grad.sizes() == shape ? grad : grad.reshape(shape);
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

struct NormNode : public torch::autograd::Function<NormNode> {
  // given_mean / given_rstd empty: batch statistics, returned as three more outputs unless
  // not kept or used for the running update (undefined tensors as empty optionals: the
  // Function takes no undefined tensor input)
  static tensor_list forward(AutogradContext* ctx, Tensor x, c10::optional<Tensor> weight,
                             c10::optional<Tensor> bias, double eps,
                             c10::optional<Tensor> given_mean, c10::optional<Tensor> given_rstd,
                             c10::intrusive_ptr<Plan> plan, bool keep_stats,
                             Running running) {
    Tensor w = optional(weight), b = optional(bias);
    Tensor fixed_mean = optional(given_mean), fixed_rstd = optional(given_rstd);
    bool fixed = fixed_mean.defined();
    // (the statistics are computed either way: the backward needs them)
    auto out = run_forward(*plan, x, w, b, eps, fixed_mean, fixed_rstd, false, true, Running());
    Tensor mean = fixed ? plan->stat(fixed_mean) : out[1];
    Tensor rstd = fixed ? plan->stat(fixed_rstd) : out[2];
    ctx->save_for_backward({x, w, mean, rstd});
    auto kept = c10::make_intrusive<Kept>();
    kept->plan = std::move(plan), kept->eps = eps, kept->fixed = fixed;
    if (b.defined()) {                 // its gradient's shape and dtype
      kept->has_bias = true;
      kept->bias_shape = b.sizes().vec();
      kept->bias_dtype = b.scalar_type();
    }
    ctx->saved_data["k"] = c10::IValue::make_capsule(std::move(kept));
    if (fixed || !keep_stats || running.update(out[1], out[3])) return {out[0]};
    ctx->mark_non_differentiable({out[1], out[2], out[3]});
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &mean = saved[2], &rstd = saved[3];
    auto kept = c10::static_intrusive_pointer_cast<Kept>(ctx->saved_data["k"].toCapsule());
    const Plan& p = *kept->plan;
    // (the Function's edges are its tensor inputs that are given: x, w, b, in that order)
    std::array<bool, 3> needs = {ctx->needs_input_grad(0),
                                 w.defined() && ctx->needs_input_grad(1),
                                 kept->has_bias && ctx->needs_input_grad(w.defined() ? 2 : 1)};
    tensor_list result(9);
    if (!(needs[0] || needs[1] || needs[2])) return result;
    Tensor g = grads[0];
    Tensor dx, dw, db;
    if (at::GradMode::is_enabled()) {
      // double backward: the operator, whose autograd differentiates the formula
      auto out = backward_op(p, g, x, w, mean, rstd, kept->eps, kept->fixed, needs);
      dx = out[0], dw = out[1], db = out[2];
    } else {
      auto out = run_backward(p, g, x, w, mean, rstd);
      dx = out[0], dw = out[1], db = out[2];
    }
    if (needs[0]) result[0] = dx.sizes() == x.sizes() ? dx : dx.reshape(x.sizes());
    if (needs[1]) result[1] = as_param(dw, w.sizes(), w.scalar_type());
    if (needs[2]) result[2] = as_param(db, kept->bias_shape, kept->bias_dtype);
    return result;
  }
};

tensor_list backward_op(const Plan& p, const Tensor& g, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, double eps, bool fixed,
                        std::array<bool, 3> needs) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("normkit::norm_backward", "");
  torch::jit::Stack stack;
  stack.reserve(13);
  stack.emplace_back(g.reshape(p.view));
  stack.emplace_back(x.reshape(p.view));
  stack.emplace_back(mean.reshape(p.stat_shape));
  stack.emplace_back(rstd.reshape(p.stat_shape));
  stack.emplace_back(w.defined() ? c10::IValue(w) : c10::IValue());
  stack.emplace_back(p.kind);
  stack.emplace_back(c10::List<int64_t>(p.view));
  stack.emplace_back(c10::List<int64_t>(p.reduce));
  stack.emplace_back(p.param_view ? c10::IValue(c10::List<int64_t>(*p.param_view))
                                  : c10::IValue());
  stack.emplace_back(eps);
  stack.emplace_back(p.center);
  stack.emplace_back(fixed);
  stack.emplace_back(c10::List<bool>({needs[0], needs[1], needs[2]}));
  op.callBoxed(&stack);
  return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor()};
}

Running running_of(const c10::optional<Tensor>& mean, const c10::optional<Tensor>& var,
                   double momentum, double unbias) {
  Running r;
  if (mean.has_value() && var.has_value()) r.mean = *mean, r.var = *var;
  r.momentum = momentum, r.unbias = unbias;
  return r;
}

// no gradient to record: y, or (y, mean, rstd, var); fixed statistics as (mean, rstd), or
// (mean, var) with from_var. Running buffers given (training BatchNorm): updated from the
// batch statistics, which are then not returned (unless they could not be: another dtype)
tensor_list forward(const Plan& plan, const Tensor& x, const c10::optional<Tensor>& w,
                    const c10::optional<Tensor>& b, double eps,
                    const c10::optional<Tensor>& fixed_mean, const c10::optional<Tensor>& fixed,
                    bool from_var, bool keep_stats, const c10::optional<Tensor>& running_mean,
                    const c10::optional<Tensor>& running_var, double momentum, double unbias) {
  return run_forward(plan, x, optional(w), optional(b), eps, optional(fixed_mean),
                     optional(fixed), from_var, keep_stats,
                     running_of(running_mean, running_var, momentum, unbias));
}

// the Python plan's backward on the same compiled kernel (no graph)
tensor_list backward(const Plan& plan, const Tensor& grad, const Tensor& x,
                     const c10::optional<Tensor>& w, const Tensor& mean, const Tensor& rstd) {
  return run_backward(plan, grad, x, optional(w), mean, rstd);
}

// recorded for autograd: (y, mean, rstd, var), or y alone with fixed statistics (mean,
// rstd; or mean, var with rstd = None), keep_stats false, or running buffers updated
tensor_list apply(Plan& plan, const Tensor& x, const c10::optional<Tensor>& w,
                  const c10::optional<Tensor>& b, double eps,
                  const c10::optional<Tensor>& fixed_mean, const c10::optional<Tensor>& rstd,
                  const c10::optional<Tensor>& var, bool keep_stats,
                  const c10::optional<Tensor>& running_mean,
                  const c10::optional<Tensor>& running_var, double momentum, double unbias) {
  Tensor r = optional(rstd);
  if (fixed_mean.has_value() && !r.defined()) {
    at::NoGradGuard no_grad;
    r = at::rsqrt(plan.stat(*var) + eps);
  }
  return NormNode::apply(x, w, b, eps, fixed_mean, c10::optional<Tensor>(r),
                         c10::intrusive_ptr<Plan>::reclaim_copy(&plan), keep_stats,
                         running_of(running_mean, running_var, momentum, unbias));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan, c10::intrusive_ptr<Plan>>(m, "Plan")
      .def(py::init([](const Tensor& like, int64_t forward_kernel, int64_t backward_kernel,
                       std::vector<int64_t> forward_consts, std::vector<int64_t> backward_consts,
                       std::vector<int64_t> stat_shape, Tensor ones, Tensor zeros,
                       bool zero_grads, std::string kind, std::vector<int64_t> view,
                       std::vector<int64_t> reduce,
                       c10::optional<std::vector<int64_t>> param_view, bool center,
                       std::vector<int64_t> work) {
             TORCH_CHECK(kAddresses + forward_consts.size() <= kStage &&
                             kAddresses + backward_consts.size() <= kStage,
                         "normkit native plan: too many kernel constants");
             TORCH_CHECK(work.size() >= 5 && work.size() <= 7, "normkit native plan: work "
                         "is (forward units, backward units, threads, partials, partial "
                         "rows[, stage-0 units[, forward stage-0 units]]), got ", work.size(),
                         " numbers");
             auto p = c10::make_intrusive<Plan>();
             p->forward_kernel = reinterpret_cast<kernel_fn>(forward_kernel);
             p->backward_kernel = reinterpret_cast<kernel_fn>(backward_kernel);
             p->forward_consts = std::move(forward_consts);
             p->backward_consts = std::move(backward_consts);
             p->stat_shape = std::move(stat_shape);
             p->ones = ones, p->zeros = zeros, p->zero_grads = zero_grads;
             p->kind = std::move(kind), p->view = std::move(view), p->reduce = std::move(reduce);
             p->param_view = std::move(param_view), p->center = center;
             p->forward_units = work[0], p->backward_units = work[1], p->threads = work[2];
             p->partials = work[3], p->partial_rows = work[4];
             p->stage_units = work.size() > 5 ? work[5] : work[4];
             p->forward_stage_units = work.size() > 6 ? work[6] : p->stage_units;
             p->dtype = like.scalar_type();
             p->numel = 1;
             for (int64_t v : p->view) p->numel *= v;
             for (int64_t v : p->stat_shape) p->stat_count *= v;
             return p;
           }))
      .def("forward", &forward, py::arg("x"), py::arg("w"), py::arg("b"), py::arg("eps"),
           py::arg("fixed_mean"), py::arg("fixed"), py::arg("from_var"), py::arg("keep_stats"),
           py::arg("running_mean") = py::none(), py::arg("running_var") = py::none(),
           py::arg("momentum") = 0.0, py::arg("unbias") = 1.0)
      .def("backward", &backward)
      .def("apply", &apply, py::arg("x"), py::arg("w"), py::arg("b"), py::arg("eps"),
           py::arg("fixed_mean"), py::arg("rstd"), py::arg("var"), py::arg("keep_stats"),
           py::arg("running_mean") = py::none(), py::arg("running_var") = py::none(),
           py::arg("momentum") = 0.0, py::arg("unbias") = 1.0);
  m.def("update_running", &update_running);
  m.def("set_team", &set_team);
}
