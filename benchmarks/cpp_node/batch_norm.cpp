// A prototype, not part of the library: BatchNorm over a contiguous float32 NCHW tensor
// (small planes) as a C++ autograd node over normkit's numba kernels (cfunc pointers set by
// bench_cpp_node.py). Training: batch statistics, running statistics updated here; eval:
// the running statistics, no graph. What it shows: the whole-model effect of a per-call
// path without Python.
#include <torch/extension.h>

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// forward a[] = (N, C, S, x, y, w, b, mean, rstd, var, fixed, from_var); backward a[] =
// (N, C, S, g, x, dx, w, mean, rstd, db, dw)
typedef void (*forward_kernel)(int64_t*, double);
typedef void (*backward_kernel)(int64_t*);
static forward_kernel FORWARD = nullptr;
static backward_kernel BACKWARD = nullptr;

void set_kernels(int64_t forward, int64_t backward) {
  FORWARD = reinterpret_cast<forward_kernel>(forward);
  BACKWARD = reinterpret_cast<backward_kernel>(backward);
}

static int64_t address(const torch::Tensor& t) {
  return reinterpret_cast<int64_t>(t.data_ptr());
}

struct TrainBatchNorm : public torch::autograd::Function<TrainBatchNorm> {
  static tensor_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w,
                             torch::Tensor b, double eps) {
    int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
    auto y = torch::empty_like(x);
    auto mean = torch::empty({c}, x.options()), rstd = torch::empty({c}, x.options());
    auto var = torch::empty({c}, x.options());
    int64_t a[12] = {n, c, s, address(x), address(y), address(w), address(b), address(mean),
                     address(rstd), address(var), 0, 0};
    FORWARD(a, eps);
    ctx->save_for_backward({x, w, mean, rstd});
    ctx->mark_non_differentiable({mean, var});
    return {y, mean, var};
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0], w = saved[1], mean = saved[2], rstd = saved[3];
    int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
    auto g = grads[0].contiguous();
    auto dx = torch::empty_like(x);
    auto db = torch::empty({c}, x.options()), dw = torch::empty({c}, x.options());
    int64_t a[11] = {n, c, s, address(g), address(x), address(dx), address(w), address(mean),
                     address(rstd), address(db), address(dw)};
    BACKWARD(a);
    return {dx, dw, db, torch::Tensor()};
  }
};

torch::Tensor batch_norm_train(torch::Tensor x, torch::Tensor w, torch::Tensor b,
                               torch::Tensor running_mean, torch::Tensor running_var,
                               double momentum, double eps) {
  auto out = TrainBatchNorm::apply(x, w, b, eps);
  double count = static_cast<double>(x.numel() / x.size(1));
  torch::NoGradGuard no_grad;
  running_mean.mul_(1.0 - momentum).add_(out[1], momentum);
  running_var.mul_(1.0 - momentum).add_(out[2], momentum * count / (count - 1.0));
  return out[0];
}

torch::Tensor batch_norm_eval(torch::Tensor x, torch::Tensor w, torch::Tensor b,
                              torch::Tensor running_mean, torch::Tensor running_var,
                              double eps) {
  int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
  auto y = torch::empty_like(x);
  int64_t a[12] = {n, c, s, address(x), address(y), address(w), address(b),
                   address(running_mean), address(running_var), address(running_mean), 1, 1};
  FORWARD(a, eps);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("batch_norm_train", &batch_norm_train);
  m.def("batch_norm_eval", &batch_norm_eval);
  m.def("set_kernels", &set_kernels);
}
