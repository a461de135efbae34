// MPI plumbing of tf_adasum's native MPI ops (adasum_mpi_ops.cc): handles
// and errors, failed communicators, the Waiter that polls requests against a
// deadline and gives them up cleanly, and the Messages that carry a range of
// the fused tensors. Included inside adasum_mpi_ops.cc's anonymous namespace
// (as its other headers are), after <mpi.h>, the standard and TensorFlow
// headers, the `using` declarations and kMaxMessageBytes.

#ifndef TF_ADASUM_NATIVE_ADASUM_MPI_WIRE_H_
#define TF_ADASUM_NATIVE_ADASUM_MPI_WIRE_H_

// ---------------------------------------------------------------------------
// Handles, errors, deadlines.

template <typename C>
C HandleAs(int64_t handle) {
  if constexpr (std::is_pointer_v<C>) {
    return reinterpret_cast<C>(static_cast<intptr_t>(handle));
  } else {
    return static_cast<C>(handle);
  }
}

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, length);
}

Status MpiStatus(int code, const char* call) {
  if (code == MPI_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("tf_adasum MPI engine: ", call, " failed: ", MpiErrorText(code)));
}

#define TFA_MPI(call)                                    \
  do {                                                   \
    Status _status = MpiStatus((call), #call);           \
    if (!_status.ok()) return _status;                   \
  } while (0)

// ---------------------------------------------------------------------------
// Failed communicators: the first failure that may have left messages in
// flight is kept as an attribute of the communicator (not copied to its
// duplicates, freed with it); every later op on it fails at once.

int DeleteFailure(MPI_Comm, int, void* value, void*) {
  delete static_cast<std::string*>(value);
  return MPI_SUCCESS;
}

int FailureKeyval() {
  static const int keyval = [] {
    int created = MPI_KEYVAL_INVALID;
    MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, DeleteFailure, &created, nullptr);
    return created;
  }();
  return keyval;
}

Status CheckNotFailed(MPI_Comm comm) {
  void* value = nullptr;
  int found = 0;
  TFA_MPI(MPI_Comm_get_attr(comm, FailureKeyval(), &value, &found));
  if (!found) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "tf_adasum MPI engine: an earlier op on this communicator failed, and messages of that op may still be "
      "in flight (a later op would take them for its own), so the communicator stays failed: restart the job. "
      "The failure: ",
      *static_cast<std::string*>(value)));
}

void MarkFailed(MPI_Comm comm, const Status& failure) {
  void* value = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(comm, FailureKeyval(), &value, &found) != MPI_SUCCESS || found) return;
  MPI_Comm_set_attr(comm, FailureKeyval(), new std::string(failure.message()));
}

// The communicator of an op, checked once per call (cheap MPI queries).
struct Comm {
  MPI_Comm comm;
  int rank;
  int size;
};

Status GetComm(int64_t handle, Comm* out) {
  int initialized = 0, finalized = 0;
  TFA_MPI(MPI_Initialized(&initialized));
  TFA_MPI(MPI_Finalized(&finalized));
  if (!initialized || finalized) {
    return absl::FailedPreconditionError(
        "tf_adasum MPI engine: MPI is not initialised (or already finalised) in this process; import "
        "mpi4py's MPI module before running the native MPI ops.");
  }
  int provided = 0;
  TFA_MPI(MPI_Query_thread(&provided));
  if (provided < MPI_THREAD_SERIALIZED) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tf_adasum MPI engine: the native MPI ops run on TensorFlow's threads, which needs MPI initialised "
        "with at least MPI_THREAD_SERIALIZED (mpi4py's default is MPI_THREAD_MULTIPLE); MPI provides level ",
        provided, "."));
  }
  out->comm = HandleAs<MPI_Comm>(handle);
  if (out->comm == MPI_COMM_NULL) {
    return absl::InvalidArgumentError("tf_adasum MPI engine: `comm` is MPI_COMM_NULL.");
  }
  TFA_MPI(MPI_Comm_rank(out->comm, &out->rank));
  TFA_MPI(MPI_Comm_size(out->comm, &out->size));
  return CheckNotFailed(out->comm);
}

// Buffers of ops that failed while MPI may still read or write them are kept
// here for the life of the process (a late peer must not write freed memory).
void KeepForever(const std::vector<Tensor>& tensors) {
  static std::mutex* mutex = new std::mutex;
  static std::vector<Tensor>* kept = new std::vector<Tensor>;
  std::lock_guard<std::mutex> lock(*mutex);
  kept->insert(kept->end(), tensors.begin(), tensors.end());
}

// Asks for transparent huge pages on a large buffer about to be written for
// the first time: the kernel then zeroes and maps it in 2 MiB pages, not
// thousands of 4 KiB page faults (which cost more than the transfer itself
// for tens of MiB on some virtual machines). Advisory; a no-op where THP is off.
void AdviseHugePages(void* data, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// Deadlines missed in this process: read at exit (comm/mpi_transport.py) to
// end the MPI job instead of waiting for stuck peers at MPI_Finalize.
std::atomic<int> g_deadlines_missed{0};

// What a receive must have received (MPI_Get_count): `count` of `type`; a
// send's entry has type MPI_DATATYPE_NULL (nothing to check).
struct Expected {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  int count = 0;
};

// Polls MPI requests until they complete or `timeout_seconds` (0: forever)
// pass. MPI progresses only inside MPI calls (a large message is copied by
// the receiver's test), so it tests often: yielding the processor between
// tests for the first 200 us, then sleeping 50 us between tests, so that
// ranks sharing cores do not take the processor from the peers they wait
// for. Measured with 4 ranks on 2 cores (float32, Adasum, median ms):
// 16 MiB 95 -> 86 and 64 MiB 358 -> 264 against yielding for 20 ms first;
// 64 KiB and 2 ranks unchanged within noise.
//
// Every failure of a wait (a deadline, an MPI error, a receive of the wrong
// size) goes through Abandon: what is still pending is cancelled, the op's
// buffers are kept for the life of the process (a late peer must not write
// freed memory) and the communicator is marked failed.
class Waiter {
 public:
  Waiter(MPI_Comm comm, double timeout_seconds, std::vector<Tensor>* buffers)
      : comm_(comm), timeout_seconds_(timeout_seconds), buffers_(buffers) {}

  // `expected`: per request, what a receive must get (null: nothing to
  // check). `collective`: the requests belong to a nonblocking collective
  // (which cannot be cancelled or freed; they are left pending on failure).
  Status Wait(std::vector<MPI_Request>* requests, const std::vector<Expected>* expected,
              const std::function<std::string()>& what, bool collective = false) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    std::vector<MPI_Status> statuses(requests->size());
    for (;;) {
      int done = 0;
      const int code = MPI_Testall(static_cast<int>(requests->size()), requests->data(), &done, statuses.data());
      if (code != MPI_SUCCESS) return Abandon(requests, Failure(code, statuses, what()), collective);
      if (done) return CheckCounts(statuses, expected, what);
      TF_RETURN_IF_ERROR(Pause(requests, start, what, collective));
    }
  }

  // Tests `requests` once (MPI_Testsome) and appends the indices of those
  // that completed to `done` (a receive's size checked against its
  // `expected`); `*pending`: whether any is left. With `block`, tests until
  // one completes or none is pending, failing past the deadline counted from
  // `start` (as Wait does). Point-to-point requests only.
  Status TestSome(std::vector<MPI_Request>* requests, const std::vector<Expected>& expected,
                  std::chrono::steady_clock::time_point start, bool block, const std::function<std::string()>& what,
                  std::vector<int>* done, bool* pending) {
    const int n = static_cast<int>(requests->size());
    std::vector<int> indices(n);
    std::vector<MPI_Status> statuses(n);  // zeroed: MPI_ERROR == MPI_SUCCESS until MPI sets it
    for (;;) {
      int completed = 0;
      const int code = MPI_Testsome(n, requests->data(), &completed, indices.data(), statuses.data());
      if (code != MPI_SUCCESS) return Abandon(requests, Failure(code, statuses, what()));
      if (completed == MPI_UNDEFINED) completed = 0;  // nothing was pending
      for (int i = 0; i < completed; ++i) {
        Status size = CheckCount(statuses[i], expected[indices[i]], what);
        if (!size.ok()) return Abandon(requests, size);
        done->push_back(indices[i]);
      }
      *pending = std::any_of(requests->begin(), requests->end(), [](MPI_Request r) { return r != MPI_REQUEST_NULL; });
      if (completed > 0 || !*pending || !block) return absl::OkStatus();
      TF_RETURN_IF_ERROR(Pause(requests, start, what, false));
    }
  }

  // Cancels and frees the pending `requests` (unless `collective`), keeps the
  // buffers, marks the communicator failed; returns `failure`.
  Status Abandon(std::vector<MPI_Request>* requests, Status failure, bool collective = false) {
    if (!collective) {
      for (MPI_Request& request : *requests) {
        if (request == MPI_REQUEST_NULL) continue;
        MPI_Cancel(&request);
        MPI_Request_free(&request);
      }
    }
    KeepForever(*buffers_);
    MarkFailed(comm_, failure);
    return failure;
  }

 private:
  static constexpr double kSpinSeconds = 200e-6;
  static constexpr long kSleepNanoseconds = 50000;

  // Between two tests: past the deadline, gives the requests up; else
  // yields the processor (the first kSpinSeconds of a wait) or sleeps.
  Status Pause(std::vector<MPI_Request>* requests, std::chrono::steady_clock::time_point start,
               const std::function<std::string()>& what, bool collective) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_seconds_ > 0 && waited > timeout_seconds_) return Expire(requests, what(), collective);
    if (waited < kSpinSeconds) {
      sched_yield();
    } else {
      const struct timespec pause = {0, kSleepNanoseconds};
      nanosleep(&pause, nullptr);
    }
    return absl::OkStatus();
  }

  static Status Failure(int code, const std::vector<MPI_Status>& statuses, const std::string& what) {
    if (code == MPI_ERR_IN_STATUS) {  // the first request's own error
      for (const MPI_Status& status : statuses) {
        if (status.MPI_ERROR != MPI_SUCCESS && status.MPI_ERROR != MPI_ERR_PENDING) {
          code = status.MPI_ERROR;
          break;
        }
      }
    }
    return absl::InternalError(absl::StrCat("tf_adasum MPI engine: ", what, " failed: ", MpiErrorText(code)));
  }

  Status CheckCounts(std::vector<MPI_Status>& statuses, const std::vector<Expected>* expected,
                     const std::function<std::string()>& what) {
    if (expected == nullptr) return absl::OkStatus();
    for (size_t i = 0; i < expected->size() && i < statuses.size(); ++i) {
      Status size = CheckCount(statuses[i], (*expected)[i], what);
      if (!size.ok()) {
        std::vector<MPI_Request> none;  // all completed
        return Abandon(&none, size);
      }
    }
    return absl::OkStatus();
  }

  // A completed request's size against what it must have received (the
  // error, not yet abandoned).
  static Status CheckCount(MPI_Status& status, const Expected& want, const std::function<std::string()>& what) {
    if (want.type == MPI_DATATYPE_NULL) return absl::OkStatus();
    int count = MPI_UNDEFINED;
    MPI_Get_count(&status, want.type, &count);
    if (count == want.count) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "tf_adasum MPI engine: ", what(), " received a message of ",
        count == MPI_UNDEFINED ? std::string("another size") : absl::StrCat(count, " items"), " where ", want.count,
        " were expected (the ranks run different programs)."));
  }

  Status Expire(std::vector<MPI_Request>* requests, const std::string& what, bool collective) {
    const std::string message = absl::StrCat(
        "tf_adasum MPI engine: ", what, " did not complete within ", timeout_seconds_,
        " s. A peer rank has failed, or ranks run different numbers of steps (shard the data so that every "
        "rank runs the same number of batches). Set TF_ADASUM_MPI_TIMEOUT to change the limit.");
    g_deadlines_missed.fetch_add(1);
    std::fprintf(stderr, "tf_adasum: %s Ending the MPI job when this process exits.\n", message.c_str());
    std::fflush(stderr);
    return Abandon(requests, absl::DeadlineExceededError(message), collective);
  }

  MPI_Comm comm_;
  double timeout_seconds_;
  std::vector<Tensor>* buffers_;  // what to keep alive when a wait fails
};

// ---------------------------------------------------------------------------
// The fused vector: the tensors of one op concatenated (no padding). A View
// says where a range of it is stored: in per-tensor buffers (inputs,
// outputs), or in one flat scratch buffer starting at logical index `origin`.

class Layout {
 public:
  explicit Layout(std::vector<int64_t> sizes) : offsets_(sizes.size() + 1, 0) {
    for (size_t t = 0; t < sizes.size(); ++t) offsets_[t + 1] = offsets_[t] + sizes[t];
  }
  int64_t total() const { return offsets_.back(); }
  int64_t offset(int t) const { return offsets_[t]; }
  int num_tensors() const { return static_cast<int>(offsets_.size()) - 1; }

  // Calls fn(t, begin, count) for each tensor t overlapping [lo, hi): its
  // elements [begin, begin + count) in fused (logical) coordinates.
  template <typename Fn>
  void ForEachPiece(int64_t lo, int64_t hi, Fn fn) const {
    if (lo >= hi) return;
    int t = static_cast<int>(std::upper_bound(offsets_.begin(), offsets_.end(), lo) - offsets_.begin()) - 1;
    for (; t < num_tensors() && offsets_[t] < hi; ++t) {
      const int64_t begin = std::max(lo, offsets_[t]), end = std::min(hi, offsets_[t + 1]);
      if (end > begin) fn(t, begin, end - begin);
    }
  }

 private:
  std::vector<int64_t> offsets_;
};

template <typename T>
struct View {
  const Layout* layout;
  std::vector<T*> tensors;  // per-tensor storage, or empty for flat storage
  T* flat = nullptr;
  int64_t origin = 0;

  T* At(int t, int64_t logical) const {
    return tensors.empty() ? flat + (logical - origin) : tensors[t] + (logical - layout->offset(t));
  }
};

// The MPI messages carrying a range of a View. A piece of at least
// kOwnMessageBytes (a large tensor's share) travels in contiguous messages of
// its own, kMaxMessageBytes each, which MPI copies once between processes on
// a node; runs of smaller pieces travel together, up to kMaxMessageBytes a
// message, with an hindexed datatype of absolute addresses (sent from
// MPI_BOTTOM). The split depends only on the range and the tensor sizes, so
// the sender's and the receiver's messages match one to one, in order.
class Messages {
 public:
  Messages() = default;
  Messages(const Messages&) = delete;
  Messages& operator=(const Messages&) = delete;
  ~Messages() {
    for (MPI_Datatype& type : types_) MPI_Type_free(&type);
  }

  template <typename T>
  Status Describe(const View<T>& view, int64_t lo, int64_t hi) {
    std::vector<std::pair<char*, int64_t>> run;  // (address, bytes) of small pieces
    int64_t run_bytes = 0, run_lo = lo, run_hi = lo;  // its size and logical range
    Status status;
    auto end_run = [&] {  // the run so far becomes a message
      if (status.ok()) status = Flush(&run, run_lo, run_hi);
      run.clear();
      run_bytes = 0;
      run_lo = run_hi;
    };
    view.layout->ForEachPiece(lo, hi, [&](int t, int64_t begin, int64_t count) {
      char* address = reinterpret_cast<char*>(view.At(t, begin));
      const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
      if (bytes < kOwnMessageBytes) {
        if (run_bytes + bytes > kMaxMessageBytes) end_run();
        if (!run.empty() && run.back().first + run.back().second == address) {
          run.back().second += bytes;  // adjacent (flat storage): one block
        } else {
          run.emplace_back(address, bytes);
        }
        run_bytes += bytes;
        run_hi = begin + count;
        return;
      }
      end_run();
      const int64_t per_message = kMaxMessageBytes / static_cast<int64_t>(sizeof(T));
      for (int64_t done = 0; done < count; done += per_message) {
        const int64_t items = std::min(per_message, count - done);
        parts_.push_back({address + done * static_cast<int64_t>(sizeof(T)),
                          static_cast<int>(items * static_cast<int64_t>(sizeof(T))), MPI_BYTE, begin + done,
                          begin + done + items});
      }
      run_lo = run_hi = begin + count;
    });
    end_run();
    return status;
  }

  size_t size() const { return parts_.size(); }

  // The range [lo, hi) of the fused vector (logical indices) that message k carries.
  int64_t lo(size_t k) const { return parts_[k].lo; }
  int64_t hi(size_t k) const { return parts_[k].hi; }

  // Posts the request of message k (a receive if !send) and appends it, with
  // what it must receive, to `requests` and `expected`.
  Status Post(size_t k, bool send, int peer, int tag, MPI_Comm comm, std::vector<MPI_Request>* requests,
              std::vector<Expected>* expected) const {
    const Part& part = parts_[k];
    MPI_Request request = MPI_REQUEST_NULL;
    const int code = send ? MPI_Isend(part.buffer, part.count, part.type, peer, tag, comm, &request)
                          : MPI_Irecv(part.buffer, part.count, part.type, peer, tag, comm, &request);
    TFA_MPI(code);
    requests->push_back(request);
    expected->push_back(send ? Expected{} : Expected{part.type, part.count});
    return absl::OkStatus();
  }

 private:
  // Pieces under this size share a message, up to kMaxMessageBytes a message
  // (256 KiB: well above Open MPI's shared-memory eager limit, so the
  // messages of large pieces move by single copy).
  static constexpr int64_t kOwnMessageBytes = kMaxMessageBytes;

  struct Part {
    void* buffer;
    int count;
    MPI_Datatype type;
    int64_t lo, hi;  // the logical range carried
  };

  // One message for a run of small pieces (the logical range [lo, hi)).
  Status Flush(std::vector<std::pair<char*, int64_t>>* run, int64_t lo, int64_t hi) {
    if (run->empty()) return absl::OkStatus();
    if (run->size() == 1 && run->front().second <= INT_MAX) {
      parts_.push_back({run->front().first, static_cast<int>(run->front().second), MPI_BYTE, lo, hi});
      run->clear();
      return absl::OkStatus();
    }
    std::vector<int> lengths;
    std::vector<MPI_Aint> displacements;
    for (const auto& [address, bytes] : *run) {  // a run holds at most kMaxMessageBytes
      MPI_Aint displacement;
      TFA_MPI(MPI_Get_address(address, &displacement));
      displacements.push_back(displacement);
      lengths.push_back(static_cast<int>(bytes));
    }
    run->clear();
    MPI_Datatype type;
    TFA_MPI(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), displacements.data(),
                                     MPI_BYTE, &type));
    types_.push_back(type);
    TFA_MPI(MPI_Type_commit(&types_.back()));
    parts_.push_back({MPI_BOTTOM, 1, types_.back(), lo, hi});
    return absl::OkStatus();
  }

  std::vector<Part> parts_;
  std::vector<MPI_Datatype> types_;  // freed with this object (MPI keeps them while in use)
};

#endif  // TF_ADASUM_NATIVE_ADASUM_MPI_WIRE_H_
