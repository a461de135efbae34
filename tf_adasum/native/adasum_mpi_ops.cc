// Native MPI ops of tf_adasum: the whole Adasum vector-halving tree of one
// bucket in one TensorFlow op, plus a float sum and a byte gather.
//
// Built and loaded by tf_adasum/engines/mpi_native.py (which documents the
// ops for Python callers). This file holds the ops' registrations and the
// tree op's kernel with the layout agreement of its ranks; the tree's
// algorithm and its semantics are in adasum_mpi_tree.h, the sum's and the
// gather's kernels in adasum_mpi_collectives.h, the MPI plumbing (errors,
// failed communicators, waits, messages) in adasum_mpi_wire.h and the
// arithmetic in adasum_kernels.h (all included below).
//
// Before any data moves, the ranks of a tree agree on its layout (a digest of
// the dtype, the rule, the tensors' sizes and the message size; see
// AgreeOnLayout): a disagreement fails the op on every rank with
// INVALID_ARGUMENT naming two ranks that differ, and every receive's size is
// checked (MPI_Get_count); the sum and the gather agree on their size (one
// small all-reduce) before their collective. An op that fails once it may
// have left messages in flight (a deadline, an MPI error, a wrong size)
// cancels what it posted, keeps its buffers for the life of the process and
// marks its communicator failed (an MPI attribute): every later op on that
// communicator fails at once, since the tags are constants and a late message
// would fill a later op's receive.

#include <atomic>
#include <cstdio>
#include <mpi.h>
#include <sched.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <limits>
#include <memory>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_adasum {
namespace {

using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::OpOutputList;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using Status = ::absl::Status;

// Tags of the ops' point-to-point messages (the ops run one at a time, in the
// same order on every rank; distinct tags keep their messages apart anyway).
constexpr int kTagHalving = 27101;
constexpr int kTagPartials = 27102;
constexpr int kTagGather = 27103;
constexpr int kTagFold = 27104;
constexpr int kTagFoldBack = 27105;
constexpr int kTagLayout = 27106;

// The most bytes one message carries. Over TCP, Open MPI moves large
// messages swapped both ways at once far below the link's rate: the tree's
// exchanges take about twice the link's time as whole messages on emulated
// 1 Gbit/s links, and least in 256 KiB ones, each receive posted just before
// its send (see Transfer; the figures are benchmarks/bare_exchange.py's, in
// docs/guide/cluster.md, "The wire alone").
constexpr int64_t kMaxMessageBytes = int64_t{256} << 10;

// ---------------------------------------------------------------------------
// MPI plumbing (handles, errors, failed communicators, waits, messages).

#include "adasum_mpi_wire.h"

// ---------------------------------------------------------------------------
// Arithmetic kernels (shared with adasum_cpu_ops.cc).

#include "adasum_kernels.h"

// ---------------------------------------------------------------------------
// The tree's algorithm: fold, vector halving, gather.

#include "adasum_mpi_tree.h"

// ---------------------------------------------------------------------------
// TfAdasumMpiTree: the kernel takes the call's tensors and buffers, has the
// ranks agree on the layout, then runs Tree<T>::Run.

template <typename T>
class TreeOp : public OpKernel {
 public:
  explicit TreeOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("comm", &comm_handle_));
    std::string rule;
    OP_REQUIRES_OK(context, context->GetAttr("rule", &rule));
    rule_ = rule == "sum" ? Rule::kSum : Rule::kAdasum;
    float timeout = 0;
    OP_REQUIRES_OK(context, context->GetAttr("timeout_seconds", &timeout));
    timeout_seconds_ = timeout;
  }

  void Compute(OpKernelContext* context) override { OP_REQUIRES_OK(context, Run(context)); }

 private:
  using Call = typename Tree<T>::Call;

  Status Run(OpKernelContext* context) {
    Call call;
    TF_RETURN_IF_ERROR(GetComm(comm_handle_, &call.comm));
    call.rule = rule_;
    OpInputList values;
    TF_RETURN_IF_ERROR(context->input_list("values", &values));
    OpOutputList combined;
    TF_RETURN_IF_ERROR(context->output_list("combined", &combined));
    const int n = values.size();
    const int size = call.comm.size;
    while (call.leaves * 2 <= size) call.leaves *= 2;
    call.folded = size - call.leaves;
    int levels = call.folded ? 1 : 0;
    for (int leaves = call.leaves; leaves > 1; leaves /= 2) ++levels;

    // Every buffer MPI may touch is a tensor in `buffers`, kept alive if a wait fails.
    std::vector<Tensor> buffers;
    Tensor* partials_tensor = nullptr;
    TF_RETURN_IF_ERROR(context->allocate_output("partials", TensorShape({levels, n, 3}), &partials_tensor));
    std::fill_n(partials_tensor->flat<double>().data(), partials_tensor->NumElements(), 0.0);
    call.partials = partials_tensor->flat<double>().data();
    Tensor other, agreement;
    TF_RETURN_IF_ERROR(context->allocate_temp(::tensorflow::DT_DOUBLE, TensorShape({3 * n}), &other));
    TF_RETURN_IF_ERROR(
        context->allocate_temp(::tensorflow::DT_INT64, TensorShape({2 * kAgreementWords}), &agreement));
    call.other = other.flat<double>().data();
    buffers.insert(buffers.end(), {*partials_tensor, other, agreement});

    std::vector<int64_t> sizes;
    for (int t = 0; t < n; ++t) sizes.push_back(values[t].NumElements());
    Layout layout(sizes);
    call.layout = &layout;
    Waiter waiter(call.comm.comm, timeout_seconds_, &buffers);
    call.waiter = &waiter;
    if (size > 1) TF_RETURN_IF_ERROR(AgreeOnLayout(&call, sizes, agreement.flat<int64_t>().data()));
    if (size == 1 || layout.total() == 0) {
      for (int t = 0; t < n; ++t) combined.set(t, values[t]);
      return absl::OkStatus();
    }
    call.in.layout = call.out.layout = &layout;
    for (int t = 0; t < n; ++t) {
      // The output takes the input's buffer when nothing else holds it
      // (e.g. an intermediate of the caller's graph): no new memory.
      Tensor* output = nullptr;
      TF_RETURN_IF_ERROR(context->forward_input_or_allocate_output({t}, t, values[t].shape(), &output));
      T* in = const_cast<T*>(values[t].flat<T>().data());  // only read (MPI takes non-const)
      T* out = output->flat<T>().data();
      if (out == in && values[t].NumElements() > 0) {
        call.in_place = true;
      } else {
        AdviseHugePages(out, output->TotalBytes());
      }
      call.in.tensors.push_back(in);
      call.out.tensors.push_back(out);
      buffers.push_back(values[t]);
      buffers.push_back(*output);
    }
    return Tree<T>::Run(context, &call, &buffers);
  }

  // -- the layout agreement ---------------------------------------------------

  // One rank's layout: its rank, the digest, and what the error names.
  struct Record {
    int64_t rank, digest, elements, tensors, dtype, rule;
  };
  static constexpr int kRecordWords = sizeof(Record) / sizeof(int64_t);
  // What a rank knows of the records it has heard of: the lowest rank's, and
  // the lowest rank's among those with another digest (rank -1: none yet).
  // Merging is associative and commutative, so after the exchanges below
  // every rank holds the same pair.
  struct Agreement {
    Record first, differing;
  };
  static constexpr int kAgreementWords = 2 * kRecordWords;
  static_assert(sizeof(Agreement) == kAgreementWords * sizeof(int64_t), "Agreement is sent as int64s");

  static Agreement Merge(const Agreement& x, const Agreement& y) {
    const Record all[4] = {x.first, x.differing, y.first, y.differing};
    Agreement out = x;
    for (const Record& r : all) {
      if (r.rank >= 0 && r.rank < out.first.rank) out.first = r;
    }
    out.differing.rank = -1;
    for (const Record& r : all) {
      if (r.rank >= 0 && r.digest != out.first.digest && (out.differing.rank < 0 || r.rank < out.differing.rank)) {
        out.differing = r;
      }
    }
    return out;
  }

  static std::string Describe(const Record& r) {
    static const char* const kNames[] = {"float16", "bfloat16", "float32", "float64"};
    const std::string dtype = r.dtype >= 0 && r.dtype < 4 ? kNames[r.dtype] : absl::StrCat("dtype ", r.dtype);
    return absl::StrCat("rank ", r.rank, " has ", r.elements, " ", dtype, " elements in ", r.tensors,
                        " tensor(s), rule '", r.rule ? "sum" : "adasum", "'");
  }

  static int64_t DtypeCode() {
    if (std::is_same_v<T, Eigen::half>) return 0;
    if (std::is_same_v<T, Eigen::bfloat16>) return 1;
    return std::is_same_v<T, float> ? 2 : 3;
  }

  // Before any data moves, the ranks exchange their layouts' records along
  // the tree's own pairs (the fold's partner sends its record in and takes
  // the result back; the leaves swap theirs at every level): every rank ends
  // with the same Agreement, so a disagreement fails the op on every rank,
  // with the same message, and no data message was posted. The digest
  // covers what decides the messages: the dtype, the rule, each tensor's
  // element count, and the message size of this library.
  Status AgreeOnLayout(Call* call, const std::vector<int64_t>& sizes, int64_t* buffer) {
    uint64_t digest = 1469598103934665603ull;  // FNV-1a over 64-bit words
    auto mix = [&](int64_t word) { digest = (digest ^ static_cast<uint64_t>(word)) * 1099511628211ull; };
    mix(1);  // the version of this agreement
    mix(kMaxMessageBytes);
    mix(DtypeCode());
    mix(static_cast<int64_t>(rule_));
    mix(static_cast<int64_t>(sizes.size()));
    int64_t elements = 0;
    for (int64_t size : sizes) {
      mix(size);
      elements += size;
    }
    const int rank = call->comm.rank, folded = call->folded;
    const Record mine{rank, static_cast<int64_t>(digest), elements, static_cast<int64_t>(sizes.size()),
                      DtypeCode(), static_cast<int64_t>(rule_)};
    Agreement state{mine, Record{-1, 0, 0, 0, 0, 0}};
    Agreement* outgoing = reinterpret_cast<Agreement*>(buffer);
    Agreement* incoming = outgoing + 1;
    auto swap = [&](int peer, bool send, bool receive) -> Status {
      *outgoing = state;
      return Tree<T>::Swap(call, peer, kTagLayout, send ? outgoing : nullptr, receive ? incoming : nullptr,
                           kAgreementWords, MPI_INT64_T,
                           [=] { return absl::StrCat("the layout agreement with rank ", peer); });
    };
    int virtual_rank = rank - folded;
    if (rank < 2 * folded) {
      if (rank % 2) {  // in with its record, back with the agreement
        TF_RETURN_IF_ERROR(swap(rank - 1, true, true));
        state = *incoming;
        return Verdict(state);
      }
      TF_RETURN_IF_ERROR(swap(rank + 1, false, true));
      state = Merge(state, *incoming);
      virtual_rank = rank / 2;
    }
    for (int bit = 1; bit < call->leaves; bit <<= 1) {
      TF_RETURN_IF_ERROR(swap(Tree<T>::RealRank(virtual_rank ^ bit, folded), true, true));
      state = Merge(state, *incoming);
    }
    if (rank < 2 * folded) TF_RETURN_IF_ERROR(swap(rank + 1, true, false));
    return Verdict(state);
  }

  static Status Verdict(const Agreement& state) {
    if (state.differing.rank < 0) return absl::OkStatus();
    const Record &a = state.first, &b = state.differing;
    const bool same_totals = a.elements == b.elements && a.tensors == b.tensors && a.dtype == b.dtype && a.rule == b.rule;
    return absl::InvalidArgumentError(absl::StrCat(
        "tf_adasum MPI engine: the ranks disagree on the tensors of this tree call, so no data was sent: ",
        Describe(a), "; ", Describe(b), same_totals ? " (the same totals in tensors of other sizes)" : "",
        ". Every rank must pass tensors of the same shapes and dtype, in the same order, with the same rule."));
  }

  int64_t comm_handle_ = 0;
  Rule rule_ = Rule::kAdasum;
  double timeout_seconds_ = 0;
};

// ---------------------------------------------------------------------------
// TfAdasumMpiAllreduce and TfAdasumMpiAllgather

#include "adasum_mpi_collectives.h"

}  // namespace

// ---------------------------------------------------------------------------
// Registration.

using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("TfAdasumMpiTree")
    .Input("values: num_tensors * T")
    .Output("combined: num_tensors * T")
    .Output("partials: float64")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("num_tensors: int >= 1")
    .Attr("comm: int")
    .Attr("rule: {'adasum', 'sum'} = 'adasum'")
    .Attr("timeout_seconds: float = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      int num_tensors = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tensors", &num_tensors));
      for (int i = 0; i < num_tensors; ++i) c->set_output(i, c->input(i));
      c->set_output(num_tensors, c->MakeShape({c->UnknownDim(), num_tensors, 3}));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The Adasum (or plain-sum) vector-halving tree over the ranks of an MPI
communicator, each tensor combined on its own; see tf_adasum/engines/mpi_native.py.
)doc");

REGISTER_OP("TfAdasumMpiAllreduce")
    .Input("x: T")
    .Output("sum: T")
    .Attr("T: {float, double}")
    .Attr("comm: int")
    .Attr("timeout_seconds: float = 0")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("Elementwise sum over the ranks of an MPI communicator (MPI_Iallreduce).");

REGISTER_OP("TfAdasumMpiAllgather")
    .Input("x: T")
    .Output("gathered: T")
    .Attr("T: {int32, int64, half, bfloat16, float, double}")
    .Attr("comm: int")
    .Attr("timeout_seconds: float = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), c->input(0), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc("[size, *x.shape]: every rank's x, in rank order (MPI_Iallgather of bytes).");

#define TFA_REGISTER_TREE(T) \
  REGISTER_KERNEL_BUILDER(   \
      Name("TfAdasumMpiTree").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), TreeOp<T>)
TFA_REGISTER_TREE(Eigen::half);
TFA_REGISTER_TREE(Eigen::bfloat16);
TFA_REGISTER_TREE(float);
TFA_REGISTER_TREE(double);
#undef TFA_REGISTER_TREE

REGISTER_KERNEL_BUILDER(Name("TfAdasumMpiAllreduce").Device(::tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
                        AllreduceOp<float>);
REGISTER_KERNEL_BUILDER(Name("TfAdasumMpiAllreduce").Device(::tensorflow::DEVICE_CPU).TypeConstraint<double>("T"),
                        AllreduceOp<double>);
REGISTER_KERNEL_BUILDER(Name("TfAdasumMpiAllgather").Device(::tensorflow::DEVICE_CPU), AllgatherOp);

}  // namespace tf_adasum

extern "C" int tf_adasum_mpi_deadlines_missed() { return tf_adasum::g_deadlines_missed.load(); }
