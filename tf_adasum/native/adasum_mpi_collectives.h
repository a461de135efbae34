// The kernels of tf_adasum's native MPI ops TfAdasumMpiAllreduce (an
// elementwise float sum) and TfAdasumMpiAllgather (every rank's bytes, in rank
// order), registered in adasum_mpi_ops.cc: one nonblocking MPI collective
// each, after the ranks agree on the size (AgreeOnSize), waited on with the
// Waiter of adasum_mpi_wire.h.
//
// Included inside adasum_mpi_ops.cc's anonymous namespace, after
// adasum_mpi_wire.h.

#ifndef TF_ADASUM_NATIVE_ADASUM_MPI_COLLECTIVES_H_
#define TF_ADASUM_NATIVE_ADASUM_MPI_COLLECTIVES_H_

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

#endif  // TF_ADASUM_NATIVE_ADASUM_MPI_COLLECTIVES_H_
