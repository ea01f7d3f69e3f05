// Two ways to record one C++ op for autograd, timed by bench_autograd_node.py: y = x * w
// (fresh y; dx = g * w), with what normkit's NormNode keeps (two saved tensors and a
// constant). `as_function`: a torch::autograd::Function (a CppNode: a context with a map of
// saved data, the outputs wrapped); `as_node`: a Node written as torch's generated ones
// (the saved tensors and constants as members, the edges and the output's history set
// here), as backends/cpu/native.cpp records its calls. Not part of the library.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::SavedVariable;
using torch::autograd::tensor_list;
using torch::autograd::variable_list;

struct Constant : torch::CustomClassHolder {
  double eps = 0.0;
};

Tensor times(const Tensor& a, const Tensor& b) {
  Tensor out = at::empty_like(a);
  at::mul_out(out, a, b);
  return out;
}

struct MulFunction : public torch::autograd::Function<MulFunction> {
  static tensor_list forward(AutogradContext* ctx, Tensor x, Tensor w) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["k"] = c10::IValue::make_capsule(c10::make_intrusive<Constant>());
    return {times(x, w)};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    auto constant = ctx->saved_data["k"].toCapsule();
    return {times(grads[0], saved[1]), Tensor()};
  }
};

struct MulNode : public torch::autograd::Node {
  using Node::Node;
  SavedVariable x_, w_;
  double eps = 0.0;
  std::string name() const override { return "MulNode"; }
  void release_variables() override { x_.reset_data(), w_.reset_data(); }
  variable_list apply(variable_list&& grads) override {
    variable_list out(2);
    if (task_should_compute_output(0)) out[0] = times(grads[0], w_.unpack());
    return out;
  }
};

Tensor as_function(const Tensor& x, const Tensor& w) { return MulFunction::apply(x, w)[0]; }

Tensor as_node(const Tensor& x, const Tensor& w) {
  Tensor y;
  {
    at::AutoGradMode no_grad(false);
    y = times(x, w);
  }
  if (torch::autograd::compute_requires_grad(x, w)) {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13   // (nodes by std::shared_ptr)
    std::shared_ptr<MulNode> node(new MulNode(torch::autograd::collect_next_edges(x, w)),
                                  torch::autograd::deleteNode);
#else
    auto node = c10::make_intrusive<MulNode>(torch::autograd::collect_next_edges(x, w));
#endif
    node->x_ = SavedVariable(x, false), node->w_ = SavedVariable(w, false);
    torch::autograd::set_history(y, node);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("as_function", &as_function);
  m.def("as_node", &as_node);
}
