// Prototypes, not part of the library: normalizations as C++ autograd nodes whose forward
// and backward call normkit's numba kernels through cfunc pointers (bench_cpp_node.py
// compiles the kernels, hands over their addresses and measures). What they show: with
// the autograd node and the output allocation in C++, a small call costs what torch's own
// costs, and small models run as fast as with torch.nn.
//
// LayerNorm over the rows of a contiguous float32 (M, K) tensor; BatchNorm over a
// contiguous float32 NCHW tensor with small planes (training: batch statistics and the
// running update; eval: the running statistics, no graph).
#include <torch/extension.h>

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

typedef void (*forward_kernel)(int64_t*, double);
typedef void (*backward_kernel)(int64_t*);

// LayerNorm: a[] = (M, K, x, y, w, b, mean, rstd) and eps / (M, K, g, x, dx, w, mean, rstd,
// dw, db). BatchNorm: a[] = (N, C, S, x, y, w, b, mean, rstd, var, fixed, from_var) and
// eps / (N, C, S, g, x, dx, w, mean, rstd, db, dw).
static forward_kernel LN_FORWARD = nullptr, BN_FORWARD = nullptr;
static backward_kernel LN_BACKWARD = nullptr, BN_BACKWARD = nullptr;

void set_kernels(int64_t ln_forward, int64_t ln_backward, int64_t bn_forward,
                 int64_t bn_backward) {
  LN_FORWARD = reinterpret_cast<forward_kernel>(ln_forward);
  LN_BACKWARD = reinterpret_cast<backward_kernel>(ln_backward);
  BN_FORWARD = reinterpret_cast<forward_kernel>(bn_forward);
  BN_BACKWARD = reinterpret_cast<backward_kernel>(bn_backward);
}

static int64_t address(const torch::Tensor& t) {
  return reinterpret_cast<int64_t>(t.data_ptr());
}

struct RowsLayerNorm : public torch::autograd::Function<RowsLayerNorm> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w,
                               torch::Tensor b, double eps) {
    int64_t m = x.size(0), k = x.size(1);
    auto y = torch::empty_like(x);
    auto mean = torch::empty({m}, x.options());
    auto rstd = torch::empty({m}, x.options());
    int64_t a[8] = {m, k, address(x), address(y), address(w), address(b), address(mean),
                    address(rstd)};
    LN_FORWARD(a, eps);
    ctx->save_for_backward({x, w, mean, rstd});
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0], w = saved[1], mean = saved[2], rstd = saved[3];
    int64_t m = x.size(0), k = x.size(1);
    auto g = grads[0].contiguous();
    auto dx = torch::empty_like(x);
    auto dw = torch::zeros({k}, x.options()), db = torch::zeros({k}, x.options());
    int64_t a[10] = {m, k, address(g), address(x), address(dx), address(w), address(mean),
                     address(rstd), address(dw), address(db)};
    LN_BACKWARD(a);
    return {dx, dw, db, torch::Tensor()};
  }
};

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor w, torch::Tensor b, double eps) {
  return RowsLayerNorm::apply(x, w, b, eps);
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
    BN_FORWARD(a, eps);
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
    BN_BACKWARD(a);
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
  BN_FORWARD(a, eps);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", &layer_norm);
  m.def("batch_norm_train", &batch_norm_train);
  m.def("batch_norm_eval", &batch_norm_eval);
  m.def("set_kernels", &set_kernels);
}
