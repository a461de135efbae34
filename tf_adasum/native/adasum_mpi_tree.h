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
// Pipelined: a level's partial sums are computed message by message as the
// partner's messages arrive (each tensor's piece in a message summed from
// zero by the kernel), and added into the level's sums in message order once
// all have arrived, so the summation order is fixed whatever the arrival
// order: a tensor's sum over a slice is the in-order sum of its 256 KiB
// pieces' sums. Once the coefficients are known, the half the next level
// sends is scaled first, the next level's exchange posted, and the half it
// keeps scaled while those messages move (testing them between chunks of a
// message's size). The fold is not pipelined (whole tensors, one Dots per
// tensor).
//
// Inputs are read in place and results written straight into the outputs
// (which take over the inputs' buffers when nothing else holds them; then, or
// after the first level, the partner's values arrive in a scratch buffer of
// two regions, one for the even levels and one for the odd: at most 3/4 of
// the fused vector, the fold's whole vector where a folded rank's outputs
// are its inputs); small
// tensors' pieces share MPI messages (an hindexed datatype), large ones go
// as messages of their own, none over 256 KiB (kMaxMessageBytes). Every wait
// polls against `timeout_seconds`, counted from the posting of the exchange it
// waits for (so a level's count includes this rank's arithmetic between the
// posting and the wait), and fails with DEADLINE_EXCEEDED naming the call and
// the peer.
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
    const bool in_fold = rank < 2 * folded;
    if (in_fold && rank % 2) {  // sends its tensors to rank - 1, then receives the result
      TF_RETURN_IF_ERROR(Transfer(call, rank - 1, &call->in, 0, total, kTagFold, nullptr, 0, 0, 0, [=] {
        return absl::StrCat("the fold send to rank ", rank - 1);
      }));
      return Transfer(call, rank - 1, nullptr, 0, 0, 0, &call->out, 0, total, kTagFoldBack, [=] {
        return absl::StrCat("the fold receive of the result from rank ", rank - 1);
      });
    }
    const int virtual_rank = in_fold ? rank / 2 : rank - folded;
    std::vector<Half> halves;  // the levels of vector halving
    for (int bit = 1; bit < call->leaves; bit <<= 1) halves.push_back(Halve(virtual_rank, bit, folded, total, halves));

    // Where the partner's values arrive: straight into the outputs while they
    // hold nothing yet (and are not the inputs), else into scratch memory,
    // allocated at its first use, of two regions: level k's values arrive in
    // region k % 2 while level k - 1 still reads the other; the fold takes both.
    bool outputs_free = !call->in_place;
    int64_t region[2] = {0, 0};  // elements
    for (size_t k = 0; k < halves.size(); ++k) {
      if (k > 0 || in_fold || !outputs_free) {
        region[k % 2] = std::max(region[k % 2], halves[k].keep_hi - halves[k].keep_lo);
      }
    }
    if (in_fold && !outputs_free) region[0] = std::max(region[0], total - region[1]);
    T* scratch = nullptr;
    auto arrival = [&](int64_t lo, int64_t hi, int which, View<T>* into) -> Status {  // which: 0, 1, or -1 (both)
      if (outputs_free) {
        *into = call->out;
        return absl::OkStatus();
      }
      if (scratch == nullptr) {
        Tensor tensor;
        const int64_t size = std::max<int64_t>(region[0] + region[1], 1);
        TF_RETURN_IF_ERROR(context->allocate_temp(DataTypeToEnum<T>::value, TensorShape({size}), &tensor));
        AdviseHugePages(tensor.flat<T>().data(), tensor.TotalBytes());
        buffers->push_back(tensor);
        scratch = tensor.flat<T>().data();
      }
      const int64_t offset = which == 1 ? region[0] : 0;
      const int64_t capacity = which < 0 ? region[0] + region[1] : region[which];
      if (hi - lo > capacity) return absl::InternalError("tf_adasum MPI engine: scratch too small");
      *into = View<T>{call->layout, {}, scratch + offset, lo};
      return absl::OkStatus();
    };

    const View<T>* mine = &call->in;  // this rank's current values
    if (in_fold) {  // a = this rank's, b = rank + 1's (whole tensors, not pipelined)
      View<T> theirs;
      TF_RETURN_IF_ERROR(arrival(0, total, -1, &theirs));
      TF_RETURN_IF_ERROR(Transfer(call, rank + 1, nullptr, 0, 0, 0, &theirs, 0, total, kTagFold, [=] {
        return absl::StrCat("the fold receive from rank ", rank + 1);
      }));
      double* sums = call->partials;
      if (call->rule == Rule::kAdasum) {
        call->layout->ForEachPiece(0, total, [&](int t, int64_t begin, int64_t count) {
          Dots(call->in.At(t, begin), theirs.At(t, begin), count, sums + 3 * t);
        });
      }
      TF_RETURN_IF_ERROR(Scale(call, call->in, theirs, Coefficients(call, sums), 0, total, nullptr));
      mine = &call->out;
      outputs_free = false;
    }
    int level = folded ? 1 : 0;

    // Phase 1: reduce-scatter by vector halving. A level's exchange is posted
    // by the level before as soon as the values it sends are final (see Half).
    std::unique_ptr<Exchange> exchange;
    for (size_t k = 0; k < halves.size(); ++k, ++level) {
      const Half& half = halves[k];
      if (exchange == nullptr) {
        View<T> theirs;
        TF_RETURN_IF_ERROR(arrival(half.keep_lo, half.keep_hi, k % 2, &theirs));
        TF_RETURN_IF_ERROR(Post(call, half, mine, &theirs, level, &exchange));
      }
      outputs_free = false;
      const View<T>& a = half.lower ? *mine : exchange->into;
      const View<T>& b = half.lower ? exchange->into : *mine;
      double* sums = call->partials + static_cast<size_t>(level) * call->layout->num_tensors() * 3;
      TF_RETURN_IF_ERROR(Receive(call, exchange.get(), a, b, sums));
      if (call->rule == Rule::kAdasum) {
        std::vector<int> group;
        for (int v = half.block_start; v < half.block_start + 2 * half.bit; ++v) group.push_back(RealRank(v, folded));
        TF_RETURN_IF_ERROR(SumOverGroup(call, sums, group, virtual_rank - half.block_start, level));
      }
      const std::vector<double> coefficients = Coefficients(call, sums);
      std::unique_ptr<Exchange> next;
      if (k + 1 < halves.size()) {  // the next level's half to send first, its exchange posted, then the rest
        const Half& after = halves[k + 1];
        TF_RETURN_IF_ERROR(Scale(call, a, b, coefficients, after.give_lo, after.give_hi, nullptr));
        View<T> theirs;
        TF_RETURN_IF_ERROR(arrival(after.keep_lo, after.keep_hi, (k + 1) % 2, &theirs));
        TF_RETURN_IF_ERROR(Post(call, after, &call->out, &theirs, level + 1, &next));
        TF_RETURN_IF_ERROR(Scale(call, a, b, coefficients, after.keep_lo, after.keep_hi, next.get()));
      } else {
        TF_RETURN_IF_ERROR(Scale(call, a, b, coefficients, half.keep_lo, half.keep_hi, nullptr));
      }
      exchange = std::move(next);
      mine = &call->out;
    }

    // Phase 2: gather the slices back (distance halving), straight into the outputs.
    for (int k = static_cast<int>(halves.size()) - 1; k >= 0; --k) {
      const Half& half = halves[k];
      const int partner = half.partner;
      TF_RETURN_IF_ERROR(Transfer(call, partner, &call->out, half.keep_lo, half.keep_hi, kTagGather, &call->out,
                                  half.give_lo, half.give_hi, kTagGather, [=] {
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
  using Clock = std::chrono::steady_clock;

  // Elements scaled between two tests of the next level's requests: a message's worth.
  static constexpr int64_t kScaleChunk = kMaxMessageBytes / static_cast<int64_t>(sizeof(T));

  // One level of vector halving, as this rank sees it.
  struct Half {
    int bit;          // the level's distance in leaves
    int partner;      // real rank of leaf virtual_rank ^ bit
    bool lower;       // this rank keeps the lower half (its values are `a`)
    int block_start;  // first leaf of the 2 * bit leaves whose sums are added
    int64_t keep_lo, keep_hi, give_lo, give_hi;
  };

  // The level of distance `bit`, after the levels in `before`, over a fused vector of `total` elements.
  static Half Halve(int virtual_rank, int bit, int folded, int64_t total, const std::vector<Half>& before) {
    const int64_t lo = before.empty() ? 0 : before.back().keep_lo;
    const int64_t hi = before.empty() ? total : before.back().keep_hi;
    const int64_t mid = lo + (hi - lo) / 2;
    Half half;
    half.bit = bit;
    half.partner = RealRank(virtual_rank ^ bit, folded);
    half.lower = !(virtual_rank & bit);
    half.block_start = virtual_rank & ~(2 * bit - 1);
    half.keep_lo = half.lower ? lo : mid;
    half.keep_hi = half.lower ? mid : hi;
    half.give_lo = half.lower ? mid : lo;
    half.give_hi = half.lower ? hi : mid;
    return half;
  }

  // An exchange in flight: this rank's message to a peer and the peer's into
  // `into`; `arrived`: receive messages that completed before anyone waited.
  struct Exchange {
    Messages send, receive;
    std::vector<MPI_Request> requests;
    std::vector<Expected> expected;
    std::vector<int> message;  // per request: its receive message's index, or -1 (a send)
    std::vector<int> arrived;
    View<T> into;
    Clock::time_point start;
    std::function<std::string()> what;
  };

  // Posts the exchange of `from`[give_lo, give_hi) (null: nothing sent) and
  // the peer's message into `into`[take_lo, take_hi) (null: nothing received).
  static Status Post(Call* call, int peer, const View<T>* from, int64_t give_lo, int64_t give_hi, int send_tag,
                     const View<T>* into, int64_t take_lo, int64_t take_hi, int receive_tag,
                     std::function<std::string()> what, std::unique_ptr<Exchange>* posted) {
    auto exchange = std::make_unique<Exchange>();
    exchange->start = Clock::now();
    exchange->what = std::move(what);
    if (into != nullptr) exchange->into = *into;
    Status described = into == nullptr ? absl::OkStatus() : exchange->receive.Describe(*into, take_lo, take_hi);
    if (described.ok() && from != nullptr) described = exchange->send.Describe(*from, give_lo, give_hi);
    if (!described.ok()) return call->waiter->Abandon(&exchange->requests, described);  // the peer's stay unmatched
    // Receive k, then send k, for each k: over TCP, Open MPI moves 256 KiB
    // messages posted so near the link's rate, and no faster than whole
    // messages with every receive posted before the first send (the
    // measurement at kMaxMessageBytes).
    MPI_Comm comm = call->comm.comm;
    const Messages& receive = exchange->receive;
    const Messages& send = exchange->send;
    for (size_t k = 0; k < std::max(receive.size(), send.size()); ++k) {
      Status status = absl::OkStatus();
      if (k < receive.size()) {
        status = receive.Post(k, false, peer, receive_tag, comm, &exchange->requests, &exchange->expected);
        if (status.ok()) exchange->message.push_back(static_cast<int>(k));
      }
      if (status.ok() && k < send.size()) {
        status = send.Post(k, true, peer, send_tag, comm, &exchange->requests, &exchange->expected);
        if (status.ok()) exchange->message.push_back(-1);
      }
      if (!status.ok()) return call->waiter->Abandon(&exchange->requests, status);
    }
    *posted = std::move(exchange);
    return absl::OkStatus();
  }

  // Posts a halving level's exchange with its partner: `from`'s give half out,
  // the partner's values for the kept half into `into`.
  static Status Post(Call* call, const Half& half, const View<T>* from, const View<T>* into, int level,
                     std::unique_ptr<Exchange>* posted) {
    const int partner = half.partner;
    return Post(call, partner, from, half.give_lo, half.give_hi, kTagHalving, into, half.keep_lo, half.keep_hi,
                kTagHalving, [=] { return absl::StrCat("the exchange of level ", level, " with rank ", partner); },
                posted);
  }

  // Waits for the exchange; `on_arrival(k)` (unless null) runs once for each
  // receive message k as it completes.
  static Status Finish(Call* call, Exchange* exchange, const std::function<void(int)>& on_arrival) {
    std::vector<int> done;
    bool pending = true;
    for (int k : exchange->arrived) {
      if (on_arrival) on_arrival(k);
    }
    while (pending) {
      done.clear();
      TF_RETURN_IF_ERROR(call->waiter->TestSome(&exchange->requests, exchange->expected, exchange->start, true,
                                                exchange->what, &done, &pending));
      for (int i : done) {
        if (exchange->message[i] >= 0 && on_arrival) on_arrival(exchange->message[i]);
      }
    }
    return absl::OkStatus();
  }

  // Tests the exchange's requests once (MPI progresses only inside MPI
  // calls), keeping the receive messages that completed for Finish.
  static Status Progress(Call* call, Exchange* exchange) {
    std::vector<int> done;
    bool pending = false;
    TF_RETURN_IF_ERROR(call->waiter->TestSome(&exchange->requests, exchange->expected, exchange->start, false,
                                              exchange->what, &done, &pending));
    for (int i : done) {
      if (exchange->message[i] >= 0) exchange->arrived.push_back(exchange->message[i]);
    }
    return absl::OkStatus();
  }

  // Sends `from`[give_lo, give_hi) to `peer` (unless `from` is null) while
  // receiving its message into `into`[take_lo, take_hi) (unless null).
  static Status Transfer(Call* call, int peer, const View<T>* from, int64_t give_lo, int64_t give_hi, int send_tag,
                         const View<T>* into, int64_t take_lo, int64_t take_hi, int receive_tag,
                         std::function<std::string()> what) {
    std::unique_ptr<Exchange> exchange;
    TF_RETURN_IF_ERROR(Post(call, peer, from, give_lo, give_hi, send_tag, into, take_lo, take_hi, receive_tag,
                            std::move(what), &exchange));
    return Finish(call, exchange.get(), nullptr);
  }

  // Waits for a halving level's exchange. Adasum: the partial sums of the
  // kept half, message by message as each arrives (a.b, |a|^2, |b|^2 of each
  // tensor's piece in the message, from zero), added into `sums` in message
  // order once all have arrived: the order is fixed whatever the arrival.
  static Status Receive(Call* call, Exchange* exchange, const View<T>& a, const View<T>& b, double* sums) {
    if (call->rule == Rule::kSum) return Finish(call, exchange, nullptr);
    struct PieceSums {
      int t;
      double s[3];
    };
    const Layout& layout = *call->layout;
    const Messages& messages = exchange->receive;
    std::vector<std::vector<PieceSums>> per_message(messages.size());
    TF_RETURN_IF_ERROR(Finish(call, exchange, [&](int k) {
      layout.ForEachPiece(messages.lo(k), messages.hi(k), [&](int t, int64_t begin, int64_t count) {
        per_message[k].push_back({t, {0.0, 0.0, 0.0}});
        Dots(a.At(t, begin), b.At(t, begin), count, per_message[k].back().s);
      });
    }));
    for (const std::vector<PieceSums>& pieces : per_message) {
      for (const PieceSums& piece : pieces) {
        for (int i = 0; i < 3; ++i) sums[3 * piece.t + i] += piece.s[i];
      }
    }
    return absl::OkStatus();
  }

  // Per tensor [c_a, c_b] from its summed [a.b, |a|^2, |b|^2] (Adasum; empty for "sum").
  static std::vector<double> Coefficients(Call* call, const double* sums) {
    std::vector<double> coefficients;
    if (call->rule == Rule::kSum) return coefficients;
    for (int t = 0; t < call->layout->num_tensors(); ++t) {
      const double* s = sums + 3 * t;
      coefficients.push_back(s[1] < kNormGuard ? 1.0 : 1.0 - s[0] / (2.0 * s[1]));
      coefficients.push_back(s[2] < kNormGuard ? 1.0 : 1.0 - s[0] / (2.0 * s[2]));
    }
    return coefficients;
  }

  // out = c_a * a + c_b * b on [lo, hi) (Adasum), or a + b ("sum"); between
  // chunks, tests `progress`'s requests (unless null).
  static Status Scale(Call* call, const View<T>& a, const View<T>& b, const std::vector<double>& coefficients,
                      int64_t lo, int64_t hi, Exchange* progress) {
    const View<T>& out = call->out;
    for (int64_t chunk = lo; chunk < hi; chunk += kScaleChunk) {
      call->layout->ForEachPiece(chunk, std::min(hi, chunk + kScaleChunk), [&](int t, int64_t begin, int64_t count) {
        if (call->rule == Rule::kSum) {
          Add(a.At(t, begin), b.At(t, begin), out.At(t, begin), count);
        } else {
          ScaledSum(a.At(t, begin), b.At(t, begin), out.At(t, begin), count, coefficients[2 * t],
                    coefficients[2 * t + 1]);
        }
      });
      if (progress != nullptr) TF_RETURN_IF_ERROR(Progress(call, progress));
    }
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
