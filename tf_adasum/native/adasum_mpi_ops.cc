// Native MPI ops of tf_adasum: the whole Adasum vector-halving tree of one
// bucket in one TensorFlow op, plus a float sum and a byte gather.
//
// Built and loaded by tf_adasum/engines/mpi_native.py (which documents the
// ops for Python callers). The MPI plumbing (errors, failed communicators,
// waits, messages) is in adasum_mpi_wire.h, the arithmetic in
// adasum_kernels.h; this file (about 700 lines) keeps the ops, whose tree
// shares one state across its phases and reads as one algorithm. The semantics are those of tf_adasum/rvh.py
// `allreduce` with the pair rules of tf_adasum/combiners.py and the math of
// tf_adasum/ops.py, per tensor:
//
// * Ranks of the communicator form the tree in rank order. With `leaves` the
//   largest power of two <= size and r = size - leaves, rank 2i+1 (i < r) sends
//   its tensors to rank 2i, which combines them (a = its own) and stands for
//   tree leaf i; leaf v is real rank 2v if v < r, else v + r.
// * Level k pairs leaf v with v ^ 2^k (vector halving): the lower leaf keeps
//   the first half of the current range of the fused (concatenated) tensors,
//   the upper one the second half; on the kept half `a` is the lower leaf's
//   value and `b` the upper one's.
// * Adasum: per tensor, float64 partial sums [a.b, |a|^2, |b|^2] over the kept
//   slice (elements cast to double before multiplying), summed over the
//   2^(k+1) ranks holding the rest of the two subtrees by recursive doubling
//   (every member ends with bitwise identical sums: a + b == b + a), then
//   c_a = 1 - a.b / (2|a|^2), exactly 1 when |a|^2 < sqrt(DBL_MIN) (same for
//   b), and c_a * a + c_b * b computed in double, cast to T once (as tf.cast
//   does: via float for half and bfloat16). "sum": a + b in T, as TF adds.
// * Phase 2 gathers the slices back (distance halving); rank 2i sends the
//   result back to 2i+1. Every element is computed by exactly one rank.
//
// Inputs are read in place and results written straight into the outputs
// (which take over the inputs' buffers when nothing else holds them); small
// tensors' pieces share MPI messages (an hindexed datatype), large ones go
// as messages of their own, none over 256 KiB (kMaxMessageBytes). Every wait
// polls against `timeout_seconds` and fails with DEADLINE_EXCEEDED naming the
// call and the peer.
//
// Before any data moves, the ranks of a tree agree on its layout (a digest of
// the dtype, the rule, the tensors' sizes and the message size; see
// AgreeOnLayout): a disagreement fails the op on every rank with
// INVALID_ARGUMENT naming two ranks that differ, and every receive's size is
// checked (MPI_Get_count); the sum and the gather agree on their size (one
// small all-reduce) before their collective. An op that fails once it may have left messages in
// flight (a deadline, an MPI error, a wrong size) cancels what it posted,
// keeps its buffers for the life of the process and marks its communicator
// failed (an MPI attribute): every later op on that communicator fails at
// once, since the tags are constants and a late message would fill a later
// op's receive.

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

// The most bytes one message carries. Over TCP, Open MPI moves a large
// message far below the link's rate: the halving levels' exchanges of 16 MiB
// on 4 emulated hosts with 1 Gbit/s links (2026-12-06, mpi4py) took 1.9-2.1x
// the link's time as whole messages, 1.22x in 1 MiB messages and 1.14x in
// 256 KiB ones, each receive posted just before its send (see Transfer).
constexpr int64_t kMaxMessageBytes = int64_t{256} << 10;

// The sqrt(DBL_MIN) guard of tf_adasum.reference.NORM_GUARD.
const double kNormGuard = std::sqrt(std::numeric_limits<double>::min());

// ---------------------------------------------------------------------------
// MPI plumbing (handles, errors, failed communicators, waits, messages).

#include "adasum_mpi_wire.h"

// ---------------------------------------------------------------------------
// Arithmetic kernels (shared with adasum_cpu_ops.cc).

#include "adasum_kernels.h"

// ---------------------------------------------------------------------------
// TfAdasumMpiTree

enum class Rule { kAdasum, kSum };

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
  // State of one call.
  struct Call {
    Comm comm;
    int leaves = 1, folded = 0;
    Layout* layout = nullptr;
    View<T> in, out;
    double* partials = nullptr;  // [levels, n, 3], this rank's (the op's output)
    double* other = nullptr;     // [n, 3], a peer's partial sums
    Waiter* waiter = nullptr;
    bool in_place = false;  // some output shares its input's buffer
  };

  static int RealRank(int virtual_rank, int folded) {
    return virtual_rank < folded ? 2 * virtual_rank : virtual_rank + folded;
  }

  Status Run(OpKernelContext* context) {
    Call call;
    TF_RETURN_IF_ERROR(GetComm(comm_handle_, &call.comm));
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
    return Tree(context, &call, &buffers);
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
      return Swap(call, peer, kTagLayout, send ? outgoing : nullptr, receive ? incoming : nullptr, kAgreementWords,
                  MPI_INT64_T, [=] { return absl::StrCat("the layout agreement with rank ", peer); });
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
      TF_RETURN_IF_ERROR(swap(RealRank(virtual_rank ^ bit, folded), true, true));
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

  Status Tree(OpKernelContext* context, Call* call, std::vector<Tensor>* buffers) {
    const int rank = call->comm.rank;
    const int folded = call->folded;
    const int64_t total = call->layout->total();
    // Where the partner's values arrive: straight into the outputs while they
    // hold nothing yet (and are not the inputs), else into scratch memory,
    // allocated at its first (largest) use.
    bool outputs_free = !call->in_place;
    Tensor scratch;
    int64_t scratch_size = 0;
    View<T> received{call->layout, {}, nullptr, 0};
    auto arrival = [&](int64_t lo, int64_t hi, const View<T>** into) -> Status {
      if (outputs_free) {
        *into = &call->out;
        return absl::OkStatus();
      }
      if (scratch_size == 0) {
        scratch_size = std::max<int64_t>(hi - lo, 1);
        TF_RETURN_IF_ERROR(context->allocate_temp(DataTypeToEnum<T>::value, TensorShape({scratch_size}), &scratch));
        AdviseHugePages(scratch.flat<T>().data(), scratch.TotalBytes());
        buffers->push_back(scratch);
        received.flat = scratch.flat<T>().data();
      }
      if (hi - lo > scratch_size) return absl::InternalError("tf_adasum MPI engine: scratch too small");
      received.origin = lo;
      *into = &received;
      return absl::OkStatus();
    };

    int virtual_rank;
    const View<T>* mine = &call->in;  // this rank's current values
    if (rank < 2 * folded) {
      if (rank % 2) {  // sends its tensors to rank - 1, then receives the result
        TF_RETURN_IF_ERROR(Transfer(call, rank - 1, &call->in, 0, total, kTagFold, nullptr, 0, 0, 0, [=] {
          return absl::StrCat("the fold send to rank ", rank - 1);
        }));
        return Transfer(call, rank - 1, nullptr, 0, 0, 0, &call->out, 0, total, kTagFoldBack, [=] {
          return absl::StrCat("the fold receive of the result from rank ", rank - 1);
        });
      }
      // Fold: a = this rank's, b = rank + 1's.
      const View<T>* theirs = nullptr;
      TF_RETURN_IF_ERROR(arrival(0, total, &theirs));
      TF_RETURN_IF_ERROR(Transfer(call, rank + 1, nullptr, 0, 0, 0, theirs, 0, total, kTagFold, [=] {
        return absl::StrCat("the fold receive from rank ", rank + 1);
      }));
      TF_RETURN_IF_ERROR(Combine(call, call->in, *theirs, 0, total, 0, nullptr, 0));
      virtual_rank = rank / 2;
      mine = &call->out;
      outputs_free = false;
    } else {
      virtual_rank = rank - folded;
    }
    int level = folded ? 1 : 0;

    // Phase 1: reduce-scatter by vector halving.
    struct Kept {
      int64_t lo, hi;
      bool lower;  // this rank kept the lower half
    };
    std::vector<Kept> kept;  // per level
    int64_t lo = 0, hi = total;
    for (int bit = 1; bit < call->leaves; bit <<= 1, ++level) {
      const int partner = RealRank(virtual_rank ^ bit, folded);
      const bool lower = !(virtual_rank & bit);
      const int64_t mid = lo + (hi - lo) / 2;
      const int64_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
      const int64_t give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
      const View<T>* theirs = nullptr;
      TF_RETURN_IF_ERROR(arrival(keep_lo, keep_hi, &theirs));
      TF_RETURN_IF_ERROR(Transfer(call, partner, mine, give_lo, give_hi, kTagHalving, theirs, keep_lo, keep_hi,
                                  kTagHalving, [=] {
                                    return absl::StrCat("the exchange of level ", level, " with rank ", partner);
                                  }));
      const View<T>& a = lower ? *mine : *theirs;
      const View<T>& b = lower ? *theirs : *mine;
      const int block_start = virtual_rank & ~(2 * bit - 1);
      std::vector<int> group;
      for (int v = block_start; v < block_start + 2 * bit; ++v) group.push_back(RealRank(v, folded));
      TF_RETURN_IF_ERROR(Combine(call, a, b, keep_lo, keep_hi, level, &group, virtual_rank - block_start));
      mine = &call->out;
      outputs_free = false;
      kept.push_back({keep_lo, keep_hi, lower});
      lo = keep_lo;
      hi = keep_hi;
    }

    // Phase 2: gather the slices back (distance halving), straight into the outputs.
    for (int k = static_cast<int>(kept.size()) - 1; k >= 0; --k) {
      const int partner = RealRank(virtual_rank ^ (1 << k), folded);
      const int64_t parent_lo = k ? kept[k - 1].lo : 0, parent_hi = k ? kept[k - 1].hi : total;
      const int64_t theirs_lo = kept[k].lower ? kept[k].hi : parent_lo;
      const int64_t theirs_hi = kept[k].lower ? parent_hi : kept[k].lo;
      TF_RETURN_IF_ERROR(Transfer(call, partner, &call->out, kept[k].lo, kept[k].hi, kTagGather, &call->out,
                                  theirs_lo, theirs_hi, kTagGather, [=] {
                                    return absl::StrCat("the gather of level ", k, " with rank ", partner);
                                  }));
    }

    if (rank < 2 * folded) {  // the result back to the folded partner
      return Transfer(call, rank + 1, &call->out, 0, total, kTagFoldBack, nullptr, 0, 0, 0, [=] {
        return absl::StrCat("the send of the result to rank ", rank + 1);
      });
    }
    return absl::OkStatus();
  }

  // Sends `from`[give_lo, give_hi) to `peer` (unless `from` is null) while
  // receiving its message into `into`[take_lo, take_hi) (unless null).
  Status Transfer(Call* call, int peer, const View<T>* from, int64_t give_lo, int64_t give_hi, int send_tag,
                  const View<T>* into, int64_t take_lo, int64_t take_hi, int receive_tag,
                  const std::function<std::string()>& what) {
    Messages send, receive;
    std::vector<MPI_Request> requests;
    std::vector<Expected> expected;
    Status described = into == nullptr ? absl::OkStatus() : receive.Describe(*into, take_lo, take_hi);
    if (described.ok() && from != nullptr) described = send.Describe(*from, give_lo, give_hi);
    if (!described.ok()) return call->waiter->Abandon(&requests, described);  // the peer's messages stay unmatched
    // Receive k, then send k, for each k: over TCP, Open MPI moved the
    // halving levels' 256 KiB messages at 1.14-1.16x the link's time posted
    // so, and at 1.9x with every receive posted before the first send (the
    // measurement at kMaxMessageBytes).
    MPI_Comm comm = call->comm.comm;
    for (size_t k = 0; k < std::max(receive.size(), send.size()); ++k) {
      Status posted = absl::OkStatus();
      if (k < receive.size()) posted = receive.Post(k, false, peer, receive_tag, comm, &requests, &expected);
      if (posted.ok() && k < send.size()) posted = send.Post(k, true, peer, send_tag, comm, &requests, &expected);
      if (!posted.ok()) return call->waiter->Abandon(&requests, posted);
    }
    return call->waiter->Wait(&requests, &expected, what);
  }

  // Combines a and b on [lo, hi) into the outputs. Adasum: partial sums over
  // the slice, summed over `group` (real ranks; this rank is group[me]) unless
  // null (the fold: whole tensors), recorded as `level`'s partials.
  Status Combine(Call* call, const View<T>& a, const View<T>& b, int64_t lo, int64_t hi, int level,
                 const std::vector<int>* group, int me) {
    const Layout& layout = *call->layout;
    const View<T>& out = call->out;
    if (rule_ == Rule::kSum) {
      layout.ForEachPiece(lo, hi, [&](int t, int64_t begin, int64_t count) {
        Add(a.At(t, begin), b.At(t, begin), out.At(t, begin), count);
      });
      return absl::OkStatus();
    }
    const int n = layout.num_tensors();
    double* sums = call->partials + static_cast<size_t>(level) * n * 3;
    layout.ForEachPiece(lo, hi, [&](int t, int64_t begin, int64_t count) {
      Dots(a.At(t, begin), b.At(t, begin), count, sums + 3 * t);
    });
    if (group != nullptr) TF_RETURN_IF_ERROR(SumOverGroup(call, sums, *group, me, level));
    layout.ForEachPiece(lo, hi, [&](int t, int64_t begin, int64_t count) {
      const double* s = sums + 3 * t;
      const double c_a = s[1] < kNormGuard ? 1.0 : 1.0 - s[0] / (2.0 * s[1]);
      const double c_b = s[2] < kNormGuard ? 1.0 : 1.0 - s[0] / (2.0 * s[2]);
      ScaledSum(a.At(t, begin), b.At(t, begin), out.At(t, begin), count, c_a, c_b);
    });
    return absl::OkStatus();
  }

  // Recursive doubling over the group's members: at each step both members
  // add the same two numbers (in either order), so all end bitwise equal.
  Status SumOverGroup(Call* call, double* sums, const std::vector<int>& group, int me, int level) {
    const int count = 3 * call->layout->num_tensors();
    double* other = call->other;  // a buffer the op keeps if the wait fails
    for (size_t bit = 1; bit < group.size(); bit <<= 1) {
      const int peer = group[me ^ bit];
      TF_RETURN_IF_ERROR(Swap(call, peer, kTagPartials, sums, other, count, MPI_DOUBLE, [&] {
        return absl::StrCat("the partial sums of level ", level, " with rank ", peer, " (group of ranks ",
                            absl::StrJoin(group, ", "), ")");
      }));
      for (int i = 0; i < count; ++i) sums[i] += other[i];
    }
    return absl::OkStatus();
  }

  // Sends `count` `type`s from `send` to `peer` while receiving as many into
  // `receive` (either may be null: nothing that way).
  static Status Swap(Call* call, int peer, int tag, void* send, void* receive, int count, MPI_Datatype type,
                     const std::function<std::string()>& what) {
    std::vector<MPI_Request> requests;
    std::vector<Expected> expected;
    for (const bool sending : {false, true}) {
      void* buffer = sending ? send : receive;
      if (buffer == nullptr) continue;
      MPI_Request request = MPI_REQUEST_NULL;
      const int code = sending ? MPI_Isend(buffer, count, type, peer, tag, call->comm.comm, &request)
                               : MPI_Irecv(buffer, count, type, peer, tag, call->comm.comm, &request);
      if (code != MPI_SUCCESS) return call->waiter->Abandon(&requests, MpiStatus(code, sending ? "MPI_Isend" : "MPI_Irecv"));
      requests.push_back(request);
      expected.push_back(sending ? Expected{} : Expected{type, count});
    }
    return call->waiter->Wait(&requests, &expected, what);
  }

  int64_t comm_handle_ = 0;
  Rule rule_ = Rule::kAdasum;
  double timeout_seconds_ = 0;
};

// ---------------------------------------------------------------------------
// TfAdasumMpiAllreduce and TfAdasumMpiAllgather

template <typename T>
MPI_Datatype MpiType();
template <>
MPI_Datatype MpiType<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype MpiType<double>() {
  return MPI_DOUBLE;
}

class CollectiveOp : public OpKernel {
 public:
  explicit CollectiveOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("comm", &comm_handle_));
    float timeout = 0;
    OP_REQUIRES_OK(context, context->GetAttr("timeout_seconds", &timeout));
    timeout_seconds_ = timeout;
  }

 protected:
  // Before any data, the ranks agree on the size: one small all-reduce of
  // {size, -size, dtype, -dtype} (MPI_MAX) tells every rank the smallest and
  // largest of each, so a disagreement fails the op on every rank, with the
  // same message and nothing sent (MPI collectives whose counts differ
  // between ranks write past the smaller buffers). `what`: "sum" or "gather".
  Status AgreeOnSize(OpKernelContext* context, const Comm& comm, Waiter* waiter, std::vector<Tensor>* buffers,
                     int64_t size, int64_t dtype, const char* what, const char* unit) {
    Tensor words;
    TF_RETURN_IF_ERROR(context->allocate_temp(::tensorflow::DT_INT64, TensorShape({8}), &words));
    buffers->push_back(words);
    int64_t* mine = words.flat<int64_t>().data();
    int64_t* all = mine + 4;
    mine[0] = size, mine[1] = -size, mine[2] = dtype, mine[3] = -dtype;
    std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
    const int code = MPI_Iallreduce(mine, all, 4, MPI_INT64_T, MPI_MAX, comm.comm, &requests[0]);
    if (code != MPI_SUCCESS) return waiter->Abandon(&requests, MpiStatus(code, "MPI_Iallreduce"), true);
    TF_RETURN_IF_ERROR(waiter->Wait(
        &requests, nullptr, [&] { return absl::StrCat("the size agreement of a ", what, " over ", comm.size, " ranks"); },
        /*collective=*/true));
    if (all[0] == -all[1] && all[2] == -all[3]) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "tf_adasum MPI engine: the ranks disagree on the tensor of this ", what, ", so no data was sent: they have ",
        -all[1], " to ", all[0], " ", unit, " of dtypes ", ::tensorflow::DataTypeString(static_cast<::tensorflow::DataType>(-all[3])),
        " to ", ::tensorflow::DataTypeString(static_cast<::tensorflow::DataType>(all[2])), " (this rank: ", size, " ",
        unit, " of ", ::tensorflow::DataTypeString(static_cast<::tensorflow::DataType>(dtype)),
        "). Every rank must pass a tensor of the same shape and dtype."));
  }

  int64_t comm_handle_ = 0;
  double timeout_seconds_ = 0;
};

template <typename T>
class AllreduceOp : public CollectiveOp {
 public:
  using CollectiveOp::CollectiveOp;

  void Compute(OpKernelContext* context) override { OP_REQUIRES_OK(context, Run(context)); }

 private:
  Status Run(OpKernelContext* context) {
    Comm comm;
    TF_RETURN_IF_ERROR(GetComm(comm_handle_, &comm));
    const Tensor& x = context->input(0);
    if (comm.size == 1) {
      context->set_output(0, x);
      return absl::OkStatus();
    }
    std::vector<Tensor> buffers = {x};
    Waiter waiter(comm.comm, timeout_seconds_, &buffers);
    TF_RETURN_IF_ERROR(AgreeOnSize(context, comm, &waiter, &buffers, x.NumElements(), DataTypeToEnum<T>::value,
                                   "sum", "elements"));
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(context->forward_input_or_allocate_output({0}, 0, x.shape(), &out));
    buffers.push_back(*out);
    const T* in = x.flat<T>().data();
    T* result = out->flat<T>().data();
    const bool in_place = result == in;  // the input's buffer was forwarded
    if (!in_place) AdviseHugePages(result, out->TotalBytes());
    const int64_t total = x.NumElements();
    // Chunks of at most INT_MAX elements (MPI counts are ints).
    for (int64_t done = 0; done < total; done += INT_MAX) {
      const int count = static_cast<int>(std::min<int64_t>(INT_MAX, total - done));
      std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
      const void* send = in_place ? MPI_IN_PLACE : static_cast<const void*>(in + done);
      const int code = MPI_Iallreduce(send, result + done, count, MpiType<T>(), MPI_SUM, comm.comm, &requests[0]);
      if (code != MPI_SUCCESS) return waiter.Abandon(&requests, MpiStatus(code, "MPI_Iallreduce"), true);
      TF_RETURN_IF_ERROR(waiter.Wait(
          &requests, nullptr,
          [&] { return absl::StrCat("a sum over the ", comm.size, " ranks of the communicator"); },
          /*collective=*/true));
    }
    return absl::OkStatus();
  }
};

class AllgatherOp : public CollectiveOp {
 public:
  using CollectiveOp::CollectiveOp;

  void Compute(OpKernelContext* context) override { OP_REQUIRES_OK(context, Run(context)); }

 private:
  Status Run(OpKernelContext* context) {
    Comm comm;
    TF_RETURN_IF_ERROR(GetComm(comm_handle_, &comm));
    const Tensor& x = context->input(0);
    const int64_t bytes = x.TotalBytes();
    std::vector<Tensor> buffers = {x};
    Waiter waiter(comm.comm, timeout_seconds_, &buffers);
    if (comm.size > 1) {
      TF_RETURN_IF_ERROR(
          AgreeOnSize(context, comm, &waiter, &buffers, bytes, x.dtype(), "gather", "bytes"));  // checks below agree
    }
    if (bytes * comm.size > INT_MAX) {  // refused before the output is allocated (every rank: the size agreed)
      return absl::InvalidArgumentError(absl::StrCat(
          "tf_adasum MPI engine: TfAdasumMpiAllgather gathers small tensors (under 2 GiB in all). Received ",
          bytes, " bytes per rank on ", comm.size, " ranks."));
    }
    TensorShape shape({comm.size});
    shape.AppendShape(x.shape());
    Tensor* out = nullptr;
    TF_RETURN_IF_ERROR(context->allocate_output(0, shape, &out));
    if (bytes == 0) return absl::OkStatus();
    buffers.push_back(*out);
    std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
    const int code = MPI_Iallgather(const_cast<char*>(x.tensor_data().data()), static_cast<int>(bytes), MPI_BYTE,
                                    const_cast<char*>(out->tensor_data().data()), static_cast<int>(bytes), MPI_BYTE,
                                    comm.comm, &requests[0]);
    if (code != MPI_SUCCESS) return waiter.Abandon(&requests, MpiStatus(code, "MPI_Iallgather"), true);
    return waiter.Wait(
        &requests, nullptr, [&] { return absl::StrCat("a gather over the ", comm.size, " ranks of the communicator"); },
        /*collective=*/true);
  }
};

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
