// normkit's CPU executor: every call that runs normkit's kernels on the CPU is a call of a
// Plan here. A Plan holds what plans.py decided once per shape (native.py builds it): the
// two kernels (numba cfuncs, see args.py), their constant arguments, how each direction
// runs in stages and its scratch, the statistics' shape and dtype, the defaults for a
// missing weight or bias, and the grouping, for the double backward. Its forward and
// backward allocate with ATen and run the kernels with no Python in between; apply does
// the same and records its autograd node (NormNode). native_support.cpp: the
// tensors' layout checks, the outputs' memory and the running buffers' update.
//
// Kernel arguments: one int64 array `a` (and eps), one slot per argument name, the same in
// every kernel (args.SLOTS, handed over by set_slots at load). The plan's constants are
// its `base` array; a call fills the tensors' addresses (contiguous memory; a statistics
// address 0: none kept), the call's flags (from_var: fixed statistics given as a variance;
// stream: non-temporal stores), the stage and the range [lo, hi) of work items.
//
// A direction runs in up to three stages (Work; entries.py): stage 0 over its work items,
// stage 1 once on this thread (merging stage 0's partial sums, in order, from the call's
// scratch), stage 2 over its work items. A stage's items are split into min(threads,
// items) contiguous ranges, run in a parallel region of torch's own OpenMP runtime
// (GOMP_parallel, from _parallel.py), with no Python callback per thread (at::
// parallel_for's region is a pragma in a header: it would bind this extension to a second
// OpenMP runtime). Without that runtime (after a fork, no OpenMP) they run in turn here.
#include <ATen/ATen.h>  // (not <torch/extension.h>, the whole C++ frontend: 35 s to build, not 23)
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <pthread.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

namespace normkit_native {   // native_support.cpp
bool rows_of_channels(const at::Tensor& x, int64_t n, int64_t c, int64_t s);
at::Tensor like_input(const at::Tensor& grad, const at::Tensor& x);
bool resident(const at::Tensor& t);
std::pair<int64_t, int64_t> huge_interior(const at::Tensor& t);
void advise_huge(const at::Tensor& t);
bool update_running(at::Tensor& running_mean, at::Tensor& running_var, const at::Tensor& mean,
                    const at::Tensor& var, double momentum, double unbias);
}  // namespace normkit_native

namespace {

using normkit_native::advise_huge;
using normkit_native::huge_interior;
using normkit_native::like_input;
using normkit_native::resident;
using normkit_native::rows_of_channels;
using normkit_native::update_running;
using torch::autograd::SavedVariable;
using torch::autograd::tensor_list;
using torch::autograd::variable_list;
using Tensor = at::Tensor;

typedef void (*kernel_fn)(int64_t*, double);

constexpr int64_t kMaxSlots = 64;

// the slots the node fills, by name (args.SLOTS); -1 until set_slots
struct Slots {
  int64_t x = -1, y = -1, w = -1, b = -1, mean = -1, rstd = -1, var = -1, g = -1, dx = -1,
          dw = -1, db = -1, scratch = -1, r = -1, h = -1, gh = -1, from_var = -1, stream = -1,
          stage = -1, lo = -1, hi = -1;
  int64_t count = 0;
} slot;

// the table, checked whole before any slot changes: a refused one leaves the slots as they were
void set_slots(const std::map<std::string, int64_t>& table) {
  int64_t count = static_cast<int64_t>(table.size());
  for (auto& [name, index] : table)
    TORCH_CHECK(index >= 0 && index < count && count <= kMaxSlots, "normkit native: slot ",
                index, " of '", name, "' outside 0..", count - 1, " (at most ", kMaxSlots,
                " slots)");
  std::map<std::string, int64_t*> mine = {
      {"x", &slot.x}, {"y", &slot.y}, {"w", &slot.w}, {"b", &slot.b}, {"mean", &slot.mean},
      {"rstd", &slot.rstd}, {"var", &slot.var}, {"g", &slot.g}, {"dx", &slot.dx},
      {"dw", &slot.dw}, {"db", &slot.db}, {"scratch", &slot.scratch},
      {"r", &slot.r}, {"h", &slot.h}, {"gh", &slot.gh},
      {"from_var", &slot.from_var}, {"stream", &slot.stream}, {"stage", &slot.stage},
      {"lo", &slot.lo}, {"hi", &slot.hi}};
  for (auto& [name, where] : mine)
    TORCH_CHECK(table.count(name), "normkit native: the argument table (args.SLOTS) has "
                "no slot '", name, "', which the C++ node fills; rebuild the extension "
                "from the installed sources");
  for (auto& [name, where] : mine) *where = table.at(name);
  slot.count = count;
}

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
    int64_t own[kMaxSlots];
    std::copy(args, args + slot.count, own);
    own[slot.lo] = r * step, own[slot.hi] = std::min(units, (r + 1) * step);
    kernel(own, eps);
  }

  // each member of the team: its ranges (all of them, in a smaller team than asked for)
  static void member(void* data) {
    const Region& job = *static_cast<const Region*>(data);
    int64_t tid = omp_thread_num(), team = omp_num_threads();
    for (int64_t r = tid; r < job.ranges; r += team) job.range(r);
  }
};

// how one direction runs (args.Work): stage 0 over `first` items, stage 1 once where
// `merge`, stage 2 over `last` items; `scratch` bytes per call
struct Work {
  int64_t first = 0, last = 0, scratch = 0;
  bool merge = false;
};

Work work_of(const std::vector<int64_t>& w) {
  TORCH_CHECK(w.size() == 4, "normkit native plan: work is (first, merge, last, scratch), "
              "got ", w.size(), " numbers");
  Work out;
  out.first = w[0], out.merge = w[1] != 0, out.last = w[2], out.scratch = w[3];
  return out;
}

struct Plan : torch::CustomClassHolder {
  kernel_fn forward_kernel = nullptr, backward_kernel = nullptr;
  std::vector<int64_t> base, stat_shape;   // the constants' argument array; statistics shape
  Work forward_work, backward_work;
  Tensor ones, zeros;           // weight, bias when None: (params,) of the statistics dtype
  // the grouping, as torch.ops.normkit.norm_backward takes it (double backward)
  std::string kind;
  std::vector<int64_t> view, reduce;
  c10::optional<std::vector<int64_t>> param_view;
  bool center = true;
  at::ScalarType dtype = at::kFloat;   // the input's, and its number of elements
  int64_t numel = 0;
  int64_t stat_count = 1;              // elements of stat_shape
  int64_t threads = 1;
  bool rows_of_channels = false;       // the kernels read channels_last memory
  bool huge = false;                   // outputs advised huge pages
  int64_t stream_bytes = 0;            // outputs from this size may stream (0: never),
  bool stream_fresh = false;           // freshly mapped ones too (tuning.stream_bytes)
  // the activation the kernels apply to y (BatchNorm; "": none) and leaky_relu's slope:
  // the kernels read them from `base` (the constants act, slope); the node keeps the bias
  // for the backward's z and hands both to norm_backward for a double backward
  std::string activation;
  double negative_slope = 0.0;

  at::ScalarType sdtype() const { return ones.scalar_type(); }

  // a weight or bias as contiguous memory of the statistics dtype
  Tensor param(const Tensor& p, const Tensor& fallback) const {
    if (!p.defined()) return fallback;
    TORCH_CHECK(p.numel() == ones.numel() && p.device().is_cpu(),
                "normkit native plan: expected a weight or bias of ", ones.numel(), " elements "
                "on the CPU, got sizes ", p.sizes(), " on ", p.device(), "; give ones that fit");
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

  Tensor empty_like(const Tensor& x) const {
    Tensor out = at::empty_like(x);
    if (huge) advise_huge(out);
    return out;
  }

  bool stream(const Tensor& out) const {
    return stream_bytes > 0 && out.numel() * out.element_size() >= stream_bytes &&
           (stream_fresh || resident(out));
  }

  // the kernel over [0, units): on this thread, or in min(threads, units) contiguous
  // ranges on torch's team (each with its own copy of the arguments)
  void run(kernel_fn kernel, int64_t* a, double eps, int64_t units) const {
    int64_t n = std::min(threads, units);
    if (n <= 1) {
      a[slot.lo] = 0, a[slot.hi] = units;
      kernel(a, eps);
      return;
    }
    int64_t step = (units + n - 1) / n;
    Region job{kernel, a, eps, units, step, (units + step - 1) / step};
    if (gomp_parallel == nullptr) {
      for (int64_t r = 0; r < job.ranges; ++r) job.range(r);
      return;
    }
    // as torch's ops, without the GIL (a backward on autograd's thread holds none): other
    std::optional<py::gil_scoped_release> no_gil;   // Python threads run meanwhile, and a
    if (PyGILState_Check()) no_gil.emplace();       // kernel's error report (numba) takes it
    gomp_parallel(&Region::member, &job, static_cast<unsigned>(job.ranges), 0);
  }

  // one direction's stages, with its scratch
  void run_stages(kernel_fn kernel, int64_t* a, double eps, const Work& work) const {
    Tensor scratch;
    if (work.scratch > 0) scratch = at::empty({work.scratch}, ones.options().dtype(at::kByte));
    a[slot.scratch] = scratch.defined() ? reinterpret_cast<int64_t>(scratch.data_ptr()) : 0;
    if (work.first > 0) {
      a[slot.stage] = 0;
      run(kernel, a, eps, work.first);
    }
    if (work.merge) {
      a[slot.stage] = 1, a[slot.lo] = 0, a[slot.hi] = 1;
      kernel(a, eps);
    }
    if (work.last > 0) {
      a[slot.stage] = 2;
      run(kernel, a, eps, work.last);
    }
  }
};

int64_t address(const Tensor& t) {
  return t.defined() ? reinterpret_cast<int64_t>(t.data_ptr()) : 0;
}

// the kernels trust the plan's sizes, dtype and memory layout (contiguous; rows of
// channels for the columns and channels_last families): a tensor of another is refused
void check_input(const Plan& p, const Tensor& x) {
  bool layout = p.rows_of_channels
                    ? rows_of_channels(x, p.view.front(),
                                       p.numel / (p.view.front() * p.view.back()), p.view.back())
                    : x.is_contiguous();
  TORCH_CHECK(layout && x.device().is_cpu() && x.scalar_type() == p.dtype &&
                  x.numel() == p.numel,
              "normkit native plan: built for a ",
              p.rows_of_channels ? "channels_last (rows of channels)" : "contiguous",
              " CPU tensor of ", p.numel, " ", c10::toString(p.dtype), " elements, got sizes ",
              x.sizes(), ", strides ", x.strides(), ", ", c10::toString(x.scalar_type()),
              "; take the plan of this input from normkit.backends.plan");
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

Tensor optional(const c10::optional<Tensor>& t) { return t.has_value() ? *t : Tensor(); }

// a residual add fused into the norm reads and writes memory of x's layout; only the rows
// kernels (LayerNorm/RMSNorm) take one
void check_added(const Plan& p, const Tensor& t) {
  TORCH_CHECK(p.kind == "layer", "normkit native plan: a residual add is fused into "
              "LayerNorm/RMSNorm plans only, this plan is for '", p.kind, "'");
  check_input(p, t);
}

// (y, mean, rstd, var) of one forward call: the statistics undefined where not kept, or
// used for the running update; with fixed statistics (fixed_mean and fixed: the rstd, or
// the variance with from_var) the given mean and rstd (undefined with from_var). With a
// residual, y normalizes h = x + residual, and h comes last.
tensor_list run_forward(const Plan& p, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps, const Tensor& fixed_mean, const Tensor& fixed,
                        bool from_var, bool keep_stats, Running running,
                        const Tensor& residual = Tensor()) {
  RECORD_FUNCTION("normkit::norm_forward", std::vector<c10::IValue>({x}));   // (profilers)
  check_input(p, x);
  Tensor y = p.empty_like(x), h;
  if (residual.defined()) check_added(p, residual), h = p.empty_like(x);
  Tensor wk = p.param(w, p.ones), bk = p.param(b, p.zeros);
  Tensor mean, rstd, var;
  bool given = fixed_mean.defined();
  keep_stats = keep_stats || running.mean.defined();   // (the update reads them)
  if (given) {
    mean = p.stat(fixed_mean);
    rstd = p.stat(fixed);
  } else if (keep_stats || p.forward_work.last > 0) {   // (stage 2 may read them)
    auto options = x.options().dtype(p.sdtype());
    mean = at::empty(p.stat_shape, options);
    rstd = at::empty(p.stat_shape, options);
    var = at::empty(p.stat_shape, options);
  }
  int64_t a[kMaxSlots];
  std::copy(p.base.begin(), p.base.end(), a);
  a[slot.x] = address(x), a[slot.y] = address(y), a[slot.w] = address(wk);
  a[slot.b] = address(bk), a[slot.mean] = address(mean), a[slot.rstd] = address(rstd);
  a[slot.var] = address(var), a[slot.from_var] = from_var ? 1 : 0;
  a[slot.r] = address(residual), a[slot.h] = address(h);
  a[slot.stream] = p.stream(y) ? 1 : 0;
  p.run_stages(p.forward_kernel, a, eps, p.forward_work);
  tensor_list out;
  if (given)
    out = {y, fixed_mean, from_var ? Tensor() : fixed, Tensor()};
  else if (running.update(mean, var) || !keep_stats)
    out = {y, Tensor(), Tensor(), Tensor()};
  else
    out = {y, mean, rstd, var};
  if (h.defined()) out.push_back(h);
  return out;
}

tensor_list backward_op(const Plan& p, const Tensor& g, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, double eps, bool fixed,
                        std::array<bool, 3> needs, const Tensor& b);

// (dx, dweight, dbias) of one backward call, the parameter gradients (params,) of the
// statistics dtype; grad_h (residual-add norms): added to dx
// b: the forward's bias, which a plan with an activation reads (its z = w * xhat + b)
tensor_list run_backward(const Plan& p, const Tensor& grad, const Tensor& x, const Tensor& w,
                         const Tensor& mean, const Tensor& rstd,
                         const Tensor& grad_h = Tensor(), const Tensor& b = Tensor()) {
  RECORD_FUNCTION("normkit::norm_backward", std::vector<c10::IValue>({grad, x}));
  check_input(p, x);
  Tensor g = like_input(grad.sizes() == x.sizes() ? grad : grad.reshape(x.sizes()), x), gh;
  if (grad_h.defined()) {
    gh = like_input(grad_h.sizes() == x.sizes() ? grad_h : grad_h.reshape(x.sizes()), x);
    check_added(p, gh);
  }
  Tensor dx = p.empty_like(x);
  auto options = x.options().dtype(p.sdtype());
  Tensor dw = at::empty({p.ones.numel()}, options), db = at::empty({p.ones.numel()}, options);
  Tensor wk = p.param(w, p.ones), ms = p.stat(mean), rs = p.stat(rstd);
  // the bias a plan with an activation reads (its z); else the plan's zeros, never read
  Tensor bk = p.activation.empty() ? p.zeros : p.param(b, p.zeros);
  int64_t a[kMaxSlots];
  std::copy(p.base.begin(), p.base.end(), a);
  a[slot.g] = address(g), a[slot.x] = address(x), a[slot.dx] = address(dx);
  a[slot.b] = address(bk);
  a[slot.w] = address(wk), a[slot.mean] = address(ms), a[slot.rstd] = address(rs);
  a[slot.dw] = address(dw), a[slot.db] = address(db), a[slot.stream] = p.stream(dx) ? 1 : 0;
  a[slot.gh] = address(gh);
  p.run_stages(p.backward_kernel, a, 0.0, p.backward_work);
  return {dx, dw, db};
}

// a gradient in its parameter's shape and dtype (no new tensor where it already is)
Tensor as_param(const Tensor& grad, at::IntArrayRef shape, at::ScalarType dtype) {
  Tensor out = grad.sizes() == shape ? grad : grad.reshape(shape);
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

// The autograd node of a recorded call (apply), as torch's generated nodes: saved tensors
// and constants as members, edges x, w, b (none for an undefined one). A torch::autograd::
// Function cost 5-6 us a call more (its context, the outputs' wrapping: bench_autograd_node.py)
struct NormNode : public torch::autograd::Node {
  using Node::Node;
  c10::intrusive_ptr<Plan> plan;
  SavedVariable x_, w_, mean_, rstd_, b_;   // b_: the forward's bias, where the plan has an
  double eps = 0.0;                         // activation (its z = w * xhat + b)
  bool fixed = false;
  std::vector<int64_t> bias_shape;          // the bias's gradient's shape and dtype
  at::ScalarType bias_dtype = at::kFloat;

  std::string name() const override { return "NormNode"; }
  void release_variables() override {
    x_.reset_data(), w_.reset_data(), mean_.reset_data(), rstd_.reset_data(), b_.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::array<bool, 3> needs = {task_should_compute_output(0), task_should_compute_output(1),
                                 task_should_compute_output(2)};
    variable_list result(3);
    if (!grads[0].defined() || !(needs[0] || needs[1] || needs[2])) return result;
    // (after release_variables, unpacking x raises torch's "backward ... a second time")
    Tensor x = x_.unpack(), w = w_.unpack(), mean = mean_.unpack(), rstd = rstd_.unpack();
    Tensor b = b_.unpack();
    // double backward: the operator, whose autograd differentiates the formula
    auto out = at::GradMode::is_enabled()
                   ? backward_op(*plan, grads[0], x, w, mean, rstd, eps, fixed, needs, b)
                   : run_backward(*plan, grads[0], x, w, mean, rstd, Tensor(), b);
    if (needs[0]) result[0] = out[0].sizes() == x.sizes() ? out[0] : out[0].reshape(x.sizes());
    if (needs[1]) result[1] = as_param(out[1], w.sizes(), w.scalar_type());
    if (needs[2]) result[2] = as_param(out[2], bias_shape, bias_dtype);
    return result;
  }
};

// a new node: torch 2.13 holds autograd nodes by c10::intrusive_ptr, 2.12 by std::shared_ptr
template <class T> auto new_node(torch::autograd::edge_list&& edges) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
  return std::shared_ptr<T>(new T(std::move(edges)), torch::autograd::deleteNode);
#else
  return c10::make_intrusive<T>(std::move(edges));
#endif
}

tensor_list backward_op(const Plan& p, const Tensor& g, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, double eps, bool fixed,
                        std::array<bool, 3> needs, const Tensor& b) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("normkit::norm_backward", "");
  torch::jit::Stack stack;
  stack.reserve(16);
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
  if (p.activation.empty()) {           // bias, activation, negative_slope: none
    stack.emplace_back(c10::IValue());
    stack.emplace_back(c10::IValue());
    stack.emplace_back(0.0);
  } else {
    stack.emplace_back(b.defined() ? c10::IValue(b) : c10::IValue());
    stack.emplace_back(p.activation);
    stack.emplace_back(p.negative_slope);
  }
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

// The Plan's calls, as Python sees them (normkit.backends.plan's protocol; add_forward
// above):
// forward  no gradient recorded: (y, mean, rstd, var) (see run_forward)
// backward (dx, dweight, dbias), None where `needs` says so; bias: the forward's (a plan
//          with an activation recomputes z from it); grad_h: added to dx (the gradient
//          of h after add_forward)
// apply    recorded for autograd: (y, mean, rstd, var), the statistics None where not
//          kept, fixed, or used for the running update
// Fixed statistics: mean with rstd, or mean with var (rstd None: computed from it).
// Running buffers (training BatchNorm): updated from the batch statistics, which are then
// not returned (unless they could not be: buffers of another dtype).
tensor_list forward(const Plan& plan, const Tensor& x, const c10::optional<Tensor>& w,
                    const c10::optional<Tensor>& b, double eps,
                    const c10::optional<Tensor>& mean, const c10::optional<Tensor>& rstd,
                    bool keep_stats, const c10::optional<Tensor>& var,
                    const c10::optional<Tensor>& running_mean,
                    const c10::optional<Tensor>& running_var, double momentum, double unbias) {
  bool from_var = mean.has_value() && !rstd.has_value();
  return run_forward(plan, x, optional(w), optional(b), eps, optional(mean),
                     from_var ? optional(var) : optional(rstd), from_var, keep_stats,
                     running_of(running_mean, running_var, momentum, unbias));
}

std::vector<c10::optional<Tensor>> backward(const Plan& plan, const Tensor& grad,
                                            const Tensor& x, const Tensor& mean,
                                            const Tensor& rstd,
                                            const c10::optional<Tensor>& w,
                                            std::array<bool, 3> needs,
                                            const c10::optional<Tensor>& bias,
                                            const c10::optional<Tensor>& grad_h) {
  auto out = run_backward(plan, grad, x, optional(w), mean, rstd, optional(grad_h),
                          optional(bias));
  std::vector<c10::optional<Tensor>> result(3);
  for (int i = 0; i < 3; ++i)
    if (needs[i]) result[i] = out[i];
  return result;
}

// add_forward (LayerNorm/RMSNorm plans): (y, h, mean, rstd), h = x + residual and y its
// norm, in one pass; no gradient recorded (autograd.AddNormFunction records it)
tensor_list add_forward(const Plan& plan, const Tensor& x, const Tensor& residual,
                        const c10::optional<Tensor>& w, const c10::optional<Tensor>& b,
                        double eps) {
  auto out = run_forward(plan, x, optional(w), optional(b), eps, Tensor(), Tensor(), false, true,
                         Running(), like_input(residual, x));
  return {out[0], out[4], out[1], out[2]};
}

tensor_list apply(Plan& plan, const Tensor& x, const c10::optional<Tensor>& weight,
                  const c10::optional<Tensor>& bias, double eps,
                  const c10::optional<Tensor>& mean, const c10::optional<Tensor>& rstd,
                  bool keep_stats, const c10::optional<Tensor>& var,
                  const c10::optional<Tensor>& running_mean,
                  const c10::optional<Tensor>& running_var, double momentum, double unbias) {
  Tensor w = optional(weight), b = optional(bias), fixed_mean = optional(mean);
  Tensor fixed_rstd = optional(rstd);
  bool fixed = fixed_mean.defined();
  Running running = running_of(running_mean, running_var, momentum, unbias);
  tensor_list out;
  Tensor saved_mean, saved_rstd;
  bool stats_back;   // the batch statistics returned: kept, and not used for the update here
  {
    at::AutoGradMode no_grad(false);
    if (fixed && !fixed_rstd.defined()) fixed_rstd = at::rsqrt(plan.stat(*var) + eps);
    // (the statistics are computed either way: the backward needs them)
    out = run_forward(plan, x, w, b, eps, fixed_mean, fixed_rstd, false, true, Running());
    saved_mean = fixed ? plan.stat(fixed_mean) : out[1];
    saved_rstd = fixed ? plan.stat(fixed_rstd) : out[2];
    stats_back = !fixed && !running.update(out[1], out[3]) &&
                 (keep_stats || running.mean.defined());
  }
  if (torch::autograd::compute_requires_grad(x, w, b)) {
    auto node = new_node<NormNode>(torch::autograd::collect_next_edges(x, w, b));
    node->plan = c10::intrusive_ptr<Plan>::reclaim_copy(&plan);
    node->x_ = SavedVariable(x, false), node->w_ = SavedVariable(w, false);
    node->mean_ = SavedVariable(saved_mean, false);
    node->rstd_ = SavedVariable(saved_rstd, false);
    if (!plan.activation.empty()) node->b_ = SavedVariable(b, false);
    node->eps = eps, node->fixed = fixed;
    if (b.defined()) node->bias_shape = b.sizes().vec(), node->bias_dtype = b.scalar_type();
    torch::autograd::set_history(out[0], node);
  }
  if (fixed) return {out[0], fixed_mean, optional(rstd), Tensor()};
  if (stats_back) return {out[0], out[1], out[2], out[3]};
  return {out[0], Tensor(), Tensor(), Tensor()};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Plan, c10::intrusive_ptr<Plan>>(m, "Plan")
      .def(py::init([](const Tensor& like, int64_t forward_kernel, int64_t backward_kernel,
                       std::vector<int64_t> base, std::vector<int64_t> forward_work,
                       std::vector<int64_t> backward_work, std::vector<int64_t> stat_shape,
                       Tensor ones, Tensor zeros, std::string kind, std::vector<int64_t> view,
                       std::vector<int64_t> reduce,
                       c10::optional<std::vector<int64_t>> param_view, bool center,
                       int64_t threads, bool rows_of_channels, bool huge,
                       int64_t stream_bytes, bool stream_fresh, std::string activation,
                       double negative_slope) {
             TORCH_CHECK(slot.count > 0, "normkit native plan: set_slots first (native.py)");
             TORCH_CHECK(static_cast<int64_t>(base.size()) == slot.count,
                         "normkit native plan: ", base.size(), " arguments, the table has ",
                         slot.count, " slots");
             auto p = c10::make_intrusive<Plan>();
             p->forward_kernel = reinterpret_cast<kernel_fn>(forward_kernel);
             p->backward_kernel = reinterpret_cast<kernel_fn>(backward_kernel);
             p->base = std::move(base);
             p->forward_work = work_of(forward_work), p->backward_work = work_of(backward_work);
             p->stat_shape = std::move(stat_shape);
             p->ones = ones, p->zeros = zeros;
             p->kind = std::move(kind), p->view = std::move(view), p->reduce = std::move(reduce);
             p->param_view = std::move(param_view), p->center = center;
             p->threads = threads, p->rows_of_channels = rows_of_channels, p->huge = huge;
             p->stream_bytes = stream_bytes, p->stream_fresh = stream_fresh;
             p->activation = std::move(activation), p->negative_slope = negative_slope;
             p->dtype = like.scalar_type();
             p->numel = 1;
             for (int64_t v : p->view) p->numel *= v;
             for (int64_t v : p->stat_shape) p->stat_count *= v;
             return p;
           }))
      .def("forward", &forward, py::arg("x"), py::arg("weight"), py::arg("bias"),
           py::arg("eps"), py::arg("mean") = py::none(), py::arg("rstd") = py::none(),
           py::arg("keep_stats") = true, py::arg("var") = py::none(),
           py::arg("running_mean") = py::none(), py::arg("running_var") = py::none(),
           py::arg("momentum") = 0.0, py::arg("unbias") = 1.0)
      .def("backward", &backward, py::arg("grad"), py::arg("x"), py::arg("mean"),
           py::arg("rstd"), py::arg("weight"), py::arg("needs"), py::arg("bias") = py::none(),
           py::arg("grad_h") = py::none())
      .def("add_forward", &add_forward, py::arg("x"), py::arg("residual"), py::arg("weight"),
           py::arg("bias"), py::arg("eps"))
      .def("apply", &apply, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
           py::arg("mean") = py::none(), py::arg("rstd") = py::none(),
           py::arg("keep_stats") = true, py::arg("var") = py::none(),
           py::arg("running_mean") = py::none(), py::arg("running_var") = py::none(),
           py::arg("momentum") = 0.0, py::arg("unbias") = 1.0)
      .def_readonly("threads", &Plan::threads)
      .def_readonly("activation", &Plan::activation);
  m.def("update_running", &update_running);
  m.def("set_team", &set_team);
  m.def("set_slots", &set_slots);
  m.def("resident", &resident);               // (tests)
  m.def("huge_interior", &huge_interior);
}
