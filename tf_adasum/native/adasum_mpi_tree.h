// The vector-halving tree of tf_adasum's native MPI op TfAdasumMpiTree
// (adasum_mpi_ops.cc, whose kernel checks the call, allocates its buffers and
// has the ranks agree on the layout before Tree<T>::Run): the fold, the
// levels of vector halving with their exchanges and combines, the partial
// sums' recursive doubling, and the gather back. The semantics are those of
// tf_adasum/tree/rvh.py `allreduce` with the pair rules of
// tf_adasum/combiners.py and the math of tf_adasum/ops.py, per tensor:
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
// Included inside adasum_mpi_ops.cc's anonymous namespace, after
// adasum_mpi_wire.h, adasum_kernels.h and the message tags (kTag*).

#ifndef TF_ADASUM_NATIVE_ADASUM_MPI_TREE_H_
#define TF_ADASUM_NATIVE_ADASUM_MPI_TREE_H_

// The sqrt(DBL_MIN) guard of tf_adasum.reference.NORM_GUARD.
const double kNormGuard = std::sqrt(std::numeric_limits<double>::min());

// The pair rule: Adasum's combine, or a plain sum (the op's rule 'sum').
enum class Rule { kAdasum, kSum };

// The tree over a communicator's ranks, for tensors of dtype T; its state is
// the Call (static members only).
template <typename T>
class Tree {
 public:
  // State of one call.
  struct Call {
    Comm comm;
    Rule rule = Rule::kAdasum;
    int leaves = 1, folded = 0;
    Layout* layout = nullptr;
    View<T> in, out;
    double* partials = nullptr;  // [levels, n, 3], this rank's (the op's output)
    double* other = nullptr;     // [n, 3], a peer's partial sums
    Waiter* waiter = nullptr;
    bool in_place = false;  // some output shares its input's buffer
  };

  // Leaf `virtual_rank`'s real rank when the first `folded` pairs are folded.
  static int RealRank(int virtual_rank, int folded) {
    return virtual_rank < folded ? 2 * virtual_rank : virtual_rank + folded;
  }

  // Combines call->in into call->out over the tree (the layout agreed); every
  // buffer MPI may touch is in `buffers`, kept alive if a wait fails.
  static Status Run(OpKernelContext* context, Call* call, std::vector<Tensor>* buffers) {
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

 private:
  // Sends `from`[give_lo, give_hi) to `peer` (unless `from` is null) while
  // receiving its message into `into`[take_lo, take_hi) (unless null).
  static Status Transfer(Call* call, int peer, const View<T>* from, int64_t give_lo, int64_t give_hi, int send_tag,
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
  static Status Combine(Call* call, const View<T>& a, const View<T>& b, int64_t lo, int64_t hi, int level,
                        const std::vector<int>* group, int me) {
    const Layout& layout = *call->layout;
    const View<T>& out = call->out;
    if (call->rule == Rule::kSum) {
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
  static Status SumOverGroup(Call* call, double* sums, const std::vector<int>& group, int me, int level) {
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
};

#endif  // TF_ADASUM_NATIVE_ADASUM_MPI_TREE_H_
