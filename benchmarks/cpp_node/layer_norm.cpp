// A prototype, not part of the library: LayerNorm over the rows of a contiguous float32
// (M, K) tensor as a C++ autograd node whose forward and backward call normkit's numba
// row kernels through cfunc pointers (bench_cpp_node.py compiles the kernels, hands over
// their addresses and measures). What it shows: with the autograd node and the output
// allocation in C++, a small call costs what torch's own LayerNorm costs.
#include <torch/extension.h>

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// a[] = (M, K, x, y, w, b, mean, rstd) and eps / (M, K, g, x, dx, w, mean, rstd, dw, db)
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

struct RowsLayerNorm : public torch::autograd::Function<RowsLayerNorm> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor w,
                               torch::Tensor b, double eps) {
    int64_t m = x.size(0), k = x.size(1);
    auto y = torch::empty_like(x);
    auto mean = torch::empty({m}, x.options());
    auto rstd = torch::empty({m}, x.options());
    int64_t a[8] = {m, k, address(x), address(y), address(w), address(b), address(mean),
                    address(rstd)};
    FORWARD(a, eps);
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
    BACKWARD(a);
    return {dx, dw, db, torch::Tensor()};
  }
};

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor w, torch::Tensor b, double eps) {
  return RowsLayerNorm::apply(x, w, b, eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm", &layer_norm);
  m.def("set_kernels", &set_kernels);
}
