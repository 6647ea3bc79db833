// The per-op checks of nanfree.debug.detect_anomaly in C++: an ATen
// RecordFunction observer (the hook the profiler uses), registered for the
// thread that enters the region and carried by the autograd engine to its
// backward threads. It sees every dispatcher op, forward and backward, without
// Python per op; only the outermost op of a nest is checked (what it calls
// inside, such as a composite op's parts or a Python kernel's torch calls, is
// covered by its outputs).
//
// After an op its outputs (and the arguments it writes) are scanned
// (debug_checks.h); an op whose output holds what the region reports becomes a
// finding with copies of the offending tensors. A forward finding is
// confirmed at once; nanfree/debug.py raises it when the torch call that ran
// the op returns. A backward finding is kept until its autograd node
// finishes: a hook on the node confirms it only if the node's outputs hold a
// non-finite value too (torch's backward formulas mask some intermediate
// values) or an input already held one, and then aborts the backward by
// throwing, which Python turns into the report. An observer's own exceptions
// would be swallowed by ATen, so it never throws; the node hook does.
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/extension.h>

#include <c10/util/SmallVector.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "debug_checks.h"
#include "python_module.h"

namespace nanfree {
namespace {

using NodePtr = decltype(torch::autograd::get_current_node());

// What the checks need of an op's schema, read once per op.
struct OpFacts {
  bool known = false;           // the op has a schema (else it is not checked)
  std::string name;             // Python's spelling: "aten.div.Tensor", "aten.log"
  std::vector<size_t> written;  // the arguments it writes in place, `(a!)`
  bool views = false;           // every output a view of an input: checked where made
  bool allocates = false;       // empty, resize_, ...: its outputs are not results
};

bool is_allocation(const std::string& name) {
  static const char* const kNames[] = {"aten::empty",         "aten::empty_like",
                                       "aten::empty_strided", "aten::new_empty",
                                       "aten::new_empty_strided", "aten::empty_permuted",
                                       "aten::resize_",       "aten::resize_as_",
                                       "aten::set_"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return false;
}

OpFacts read_facts(const at::RecordFunction& fn) {
  OpFacts facts;
  const std::optional<c10::FunctionSchema> schema = fn.operator_schema();
  if (!schema.has_value()) return facts;
  facts.known = true;
  const std::string full = schema->name();
  facts.allocates = is_allocation(full);
  const size_t colons = full.find("::");
  facts.name = colons == std::string::npos
                   ? full
                   : full.substr(0, colons) + "." + full.substr(colons + 2);
  if (!schema->overload_name().empty() && schema->overload_name() != "default") {
    facts.name += "." + schema->overload_name();
  }
  const auto& args = schema->arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() != nullptr && args[i].alias_info()->isWrite()) {
      facts.written.push_back(i);
    }
  }
  const auto& returns = schema->returns();
  facts.views = !returns.empty() && facts.written.empty();
  for (const auto& r : returns) {
    if (r.alias_info() == nullptr || r.alias_info()->isWrite()) facts.views = false;
  }
  return facts;
}

struct PairHash {
  size_t operator()(const std::pair<const char*, const char*>& p) const {
    return std::hash<const void*>()(p.first) * 31 + std::hash<const void*>()(p.second);
  }
};

// The op's facts, cached per thread by its (name, overload) strings, which
// live as long as the op's registration.
const OpFacts& facts_of(const at::RecordFunction& fn) {
  thread_local std::unordered_map<std::pair<const char*, const char*>, OpFacts, PairHash> cache;
  const auto key = std::make_pair(fn.name(), fn.overload_name());
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, read_facts(fn)).first;
  return it->second;
}

void collect(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) collect(e, out);
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) collect(e, out);
  }
}

// A dense tensor with values of a floating or complex dtype, as the checks
// read it (float8 widened; complex as its real and imaginary parts), else
// an undefined tensor.
at::Tensor checked(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || t.device().is_meta() || t.numel() == 0 ||
      !(t.is_floating_point() || t.is_complex())) {
    return at::Tensor();
  }
  at::Tensor x = t.detach();
  if (x.is_complex()) x = at::view_as_real(x);
  if (x.element_size() == 1) x = x.to(at::kFloat);  // float8: no isfinite of its own
  return x;
}

// Whether t holds NaN (or +-inf with check_inf): the scan, else ATen (a sum
// first: finite entries give a finite sum unless it overflows, which only
// sends it on to the exact test). Run with the observer switched off.
bool holds(const at::Tensor& t, bool check_inf) {
  const int scanned = any_nonfinite({t}, check_inf);
  if (scanned >= 0) return scanned == 1;
  const at::Tensor x = checked(t);
  if (!x.defined()) return false;
  const double total =
      (x.element_size() < 4 ? x.sum(at::kFloat) : x.sum()).item<double>();
  if (std::isfinite(total)) return false;
  return check_inf ? !at::isfinite(x).all().item<bool>() : at::isnan(x).any().item<bool>();
}

bool any_holds(const std::vector<at::Tensor>& tensors, bool check_inf) {
  const int scanned = any_nonfinite(tensors, check_inf);
  if (scanned >= 0) return scanned == 1;
  for (const at::Tensor& t : tensors) {
    if (holds(t, check_inf)) return true;
  }
  return false;
}

bool has_value(const at::Tensor& t, double value) {
  const at::Tensor x = checked(t);
  return x.defined() && at::eq(x, value).any().item<bool>();
}

// -inf is the only non-finite value (what `allow` may let pass).
bool minus_inf_only(const at::Tensor& t) {
  const at::Tensor x = checked(t);
  return x.defined() && !at::isnan(x).any().item<bool>() &&
         !at::eq(x, std::numeric_limits<double>::infinity()).any().item<bool>();
}

struct Finding {
  std::string op;
  NodePtr node;  // the autograd node running the op; null in the forward
  bool confirmed = false;
  std::vector<at::Tensor> inputs, outputs;  // for their dtypes and shapes
  std::vector<at::Tensor> offending;        // copies, as the op left them
  std::vector<at::Tensor> bad_inputs;       // copies
  bool minus_inf_in = false;                // a read input held -inf
  bool minus_inf_only = false;              // the offending outputs hold no NaN, no +inf
};

// The region's state: one region at a time (nanfree/debug.py nests regions).
struct Region {
  std::mutex mutex;
  bool active = false;
  bool check_inf = true;
  bool allow = false;  // the region lets some -inf pass: Python decides those
  std::vector<Finding> findings;
  std::atomic<int> confirmed{0};
  std::vector<torch::autograd::Node*> hooked;  // nodes given a hook in this region
  at::CallbackHandle handle = 0;
};

Region& region() {
  static Region r;
  return r;
}

struct ThreadState {
  int depth = 0;  // ops running on this thread, outermost first
  // Tensors an allocation op returned and no op has written yet (their
  // bits are not results, and an op writing them did not inherit them).
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> fresh;
};

ThreadState& thread_state() {
  thread_local ThreadState s;
  return s;
}

// Whether t was fresh (and forgets it: it is being written).
bool take_fresh(const at::Tensor& t) {
  auto& fresh = thread_state().fresh;
  for (size_t i = 0; i < fresh.size(); ++i) {
    if (fresh[i]._unsafe_get_target() == t.unsafeGetTensorImpl() && !fresh[i].expired()) {
      fresh.erase(fresh.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
  }
  return false;
}

void add_fresh(const at::Tensor& t) {
  auto& fresh = thread_state().fresh;
  if (fresh.size() >= 256) {  // forget those that died
    std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> live;
    for (auto& w : fresh) {
      if (!w.expired()) live.push_back(w);
    }
    fresh.swap(live);
    if (fresh.size() >= 256) fresh.erase(fresh.begin());
  }
  fresh.emplace_back(t.getIntrusivePtr());
}

// An outermost op's arguments, captured when it starts (the observer reads
// the inputs only then).
struct OpContext : public at::ObserverContext {
  const OpFacts* facts = nullptr;
  std::vector<at::Tensor> inputs;
  c10::SmallVector<char, 8> written;  // per input: the op writes it
  c10::SmallVector<char, 8> held;     // per written input: it held a non-finite value before
};

// Confirms or drops the findings of its node when the node has run, and
// aborts the backward when one is confirmed that Python need not judge.
struct NodeCheck : public torch::autograd::FunctionPostHook {
  explicit NodeCheck(torch::autograd::Node* node) : node_(node) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grad_inputs,
                                            const torch::autograd::variable_list&) override {
    Region& r = region();
    bool abort = false;
    {
      at::DisableRecordFunctionGuard off;  // the checks' own ops are not the region's
      std::lock_guard<std::mutex> lock(r.mutex);
      if (!r.active) return grad_inputs;
      bool outputs_bad = false;
      bool outputs_read = false;
      std::vector<Finding> kept;
      for (Finding& f : r.findings) {
        if (f.confirmed || f.node.get() != node_) {
          kept.push_back(std::move(f));
          continue;
        }
        if (!outputs_read) {
          outputs_read = true;
          std::vector<at::Tensor> outs;
          for (const auto& g : grad_inputs) {
            if (g.defined()) outs.push_back(g);
          }
          outputs_bad = any_holds(outs, r.check_inf);
        }
        // A node's non-finite intermediate that no output holds was masked.
        if (!outputs_bad && f.bad_inputs.empty()) continue;
        f.confirmed = true;
        ++r.confirmed;
        abort = abort || !(r.allow && f.minus_inf_only);
        kept.push_back(std::move(f));
      }
      r.findings.swap(kept);
    }
    if (abort) {
      throw std::runtime_error(
          "nanfree.debug.detect_anomaly: a non-finite value in the backward (the region "
          "reports where)");
    }
    return grad_inputs;
  }

 private:
  torch::autograd::Node* node_;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const OpFacts& facts = facts_of(fn);
  // Not an op (the engine's records of a node's evaluation, ...): not counted.
  if (!facts.known) return nullptr;
  ThreadState& ts = thread_state();
  if (ts.depth++ > 0) return nullptr;  // inside another op: its outputs cover this one
  if (facts.views) return nullptr;
  auto ctx = std::make_unique<OpContext>();
  ctx->facts = &facts;
  if (facts.allocates) return ctx;
  const auto args = fn.inputs();
  for (size_t i = 0; i < args.size(); ++i) {
    const size_t before = ctx->inputs.size();
    collect(args[i], ctx->inputs);
    bool writes = false;
    for (size_t w : facts.written) writes = writes || w == i;
    ctx->written.resize(ctx->inputs.size(), writes ? 1 : 0);
    ctx->held.resize(ctx->inputs.size(), 0);
    if (!writes) continue;
    at::DisableRecordFunctionGuard off;
    for (size_t j = before; j < ctx->inputs.size(); ++j) {
      // What a written argument held before the op: a fresh buffer held nothing.
      ctx->held[j] = !take_fresh(ctx->inputs[j]) && holds(ctx->inputs[j], region().check_inf);
    }
  }
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  if (raw == nullptr) {
    if (facts_of(fn).known) --thread_state().depth;
    return;
  }
  --thread_state().depth;
  auto* ctx = static_cast<OpContext*>(raw);
  std::vector<at::Tensor> outputs;
  for (const c10::IValue& v : fn.outputs()) collect(v, outputs);
  if (ctx->facts->allocates) {
    for (const at::Tensor& t : outputs) add_fresh(t);
    return;
  }
  for (size_t i = 0; i < ctx->inputs.size(); ++i) {
    if (!ctx->written[i]) continue;
    bool listed = false;
    for (const at::Tensor& t : outputs) listed = listed || t.is_same(ctx->inputs[i]);
    if (!listed) outputs.push_back(ctx->inputs[i]);
  }
  Region& r = region();
  at::DisableRecordFunctionGuard off;  // the checks' own ops are not the region's
  if (!any_holds(outputs, r.check_inf)) return;  // the common case: one scan
  Finding f;
  for (const at::Tensor& t : outputs) {
    if (holds(t, r.check_inf)) f.offending.push_back(t.detach().clone());
  }
  if (f.offending.empty()) return;
  f.op = ctx->facts->name;
  f.node = torch::autograd::get_current_node();
  f.outputs = outputs;
  f.inputs = ctx->inputs;
  f.minus_inf_only = true;
  for (const at::Tensor& t : f.offending) f.minus_inf_only = f.minus_inf_only && minus_inf_only(t);
  for (size_t i = 0; i < ctx->inputs.size(); ++i) {
    const at::Tensor& t = ctx->inputs[i];
    // Written arguments count as inputs by what they held before the op.
    if (ctx->written[i] ? ctx->held[i] != 0 : holds(t, r.check_inf)) {
      f.bad_inputs.push_back(t.detach().clone());
    }
    if (!ctx->written[i] && has_value(t, -std::numeric_limits<double>::infinity())) {
      f.minus_inf_in = true;
    }
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.active) return;
  if (!f.node) {
    f.confirmed = true;
    ++r.confirmed;
  } else {
    torch::autograd::Node* node = f.node.get();
    bool hooked = false;
    for (torch::autograd::Node* n : r.hooked) hooked = hooked || n == node;
    if (!hooked) {
      r.hooked.push_back(node);
      node->add_post_hook(std::make_unique<NodeCheck>(node));
    }
  }
  r.findings.push_back(std::move(f));
}

void start(bool check_inf, bool allow) {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mutex);
  TORCH_CHECK(!r.active, "nanfree.debug.detect_anomaly: a region is already being observed");
  r.active = true;
  r.check_inf = check_inf;
  r.allow = allow;
  r.findings.clear();
  r.hooked.clear();
  r.confirmed = 0;
  thread_state().depth = 0;
  r.handle = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                            .needsInputs(true)
                                            .needsOutputs(true)
                                            .scopes({at::RecordScope::FUNCTION}));
}

void stop() {
  Region& r = region();
  at::CallbackHandle handle = 0;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!r.active) return;
    r.active = false;
    handle = r.handle;
    r.findings.clear();
    r.hooked.clear();  // a hook left on a node does nothing once inactive
    r.confirmed = 0;
  }
  at::removeCallback(handle);
  thread_state().fresh.clear();
}

int confirmed_count() { return region().confirmed.load(); }

// The confirmed findings in the order their ops ran, as dicts; they leave
// the region's list (pending backward ones stay).
pybind11::list take_confirmed() {
  Region& r = region();
  std::vector<Finding> taken;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    std::vector<Finding> kept;
    for (Finding& f : r.findings) (f.confirmed ? taken : kept).push_back(std::move(f));
    r.findings.swap(kept);
    r.confirmed = 0;
  }
  pybind11::list out;
  for (Finding& f : taken) {
    pybind11::dict d;
    d["op"] = f.op;
    d["node"] = f.node ? pybind11::reinterpret_steal<pybind11::object>(
                             torch::autograd::functionToPyObject(f.node))
                       : pybind11::none();
    d["inputs"] = f.inputs;
    d["outputs"] = f.outputs;
    d["offending"] = f.offending;
    d["bad_inputs"] = f.bad_inputs;
    d["minus_inf_in"] = f.minus_inf_in;
    d["minus_inf_only"] = f.minus_inf_only;
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_debug_observer(pybind11::module_& m) {
  m.def("anomaly_observer_start", &start, pybind11::arg("check_inf"), pybind11::arg("allow"),
        "observe every op run by this thread (and its backward) until anomaly_observer_stop");
  m.def("anomaly_observer_stop", &stop, "remove the observer and forget its findings");
  m.def("anomaly_confirmed", &confirmed_count, "how many confirmed findings wait to be taken");
  m.def("next_sequence_nr", &at::sequence_number::peek,
        "the sequence number the next autograd node made by this thread gets");
  m.def("anomaly_take_confirmed", &take_confirmed,
        "the confirmed findings (dicts) in the order their ops ran");
}

}  // namespace nanfree
