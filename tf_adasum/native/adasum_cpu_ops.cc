// CPU kernels of tf_adasum's Adasum arithmetic: the two kernels of
// tf_adasum/ops.py on a slice of a fused buffer, multi-threaded; and the
// registrations of this library's ops, the compressed wire's encoder and
// decoder among them (TfAdasumEncodeBlocks and TfAdasumDecodeBlocks, whose
// kernels are in adasum_compression.h).
//
// Built and loaded by tf_adasum/ops.py (through tf_adasum/native/build.py),
// with the arithmetic of adasum_kernels.h. The semantics are those of
// ops.partial_dots and ops.scaled_sum:
//
// * a and b are [m]: the same slice of the left operand and of the right.
//   The slice holds whole blocks of 128 elements; tensor `first + i` owns
//   `counts[i]` consecutive blocks, and the counts add up to the slice
//   (counts = [-1]: all of the slice, of any length, belongs to `first`).
// * TfAdasumPartialDots: float64 [num_tensors, 3], per tensor
//   [a.b, |a|^2, |b|^2] over its elements in the slice (zeros for tensors
//   outside it); elements cast to double before multiplying.
// * TfAdasumScaledSum: T [m], c_a[t] * a + c_b[t] * b in double for the
//   elements of tensor t, cast to T once (as tf.cast rounds).
//
// Work is split into chunks of at most kChunk elements of one tensor and
// spread over the device's intra-op threads. Each chunk's sums are kept
// apart and added per tensor in chunk order afterwards, so the result does
// not depend on the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/util/work_sharder.h"

namespace tf_adasum {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using Status = ::absl::Status;

#include "adasum_kernels.h"

constexpr int64_t kBlock = 128;          // tf_adasum.ops.BLOCK
constexpr int64_t kChunk = int64_t{1} << 15;  // elements per unit of work

struct Chunk {
  int64_t begin, end;  // elements of the slice
  int tensor;          // index in the bucket
};

// The slice's elements in chunks of one tensor each, in order.
Status MakeChunks(int64_t m, int first, const std::vector<int>& counts, int num_tensors, std::vector<Chunk>* chunks) {
  if (counts.empty() || first < 0 || first + static_cast<int64_t>(counts.size()) > num_tensors) {
    return absl::InvalidArgumentError(absl::StrCat("tensors [", first, ", ", first + counts.size(),
                                                   ") of the slice are not within num_tensors=", num_tensors));
  }
  const bool whole = counts.size() == 1 && counts[0] == -1;
  int64_t blocks = 0;
  for (int c : counts) {
    if (c < 0 && !whole) {
      return absl::InvalidArgumentError(absl::StrCat("block counts must be >= 0 (or exactly [-1]); received ", c));
    }
    blocks += c;
  }
  if (!whole && (m % kBlock != 0 || blocks * kBlock != m)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the slice has ", m, " elements, not the ", blocks, " blocks of ", kBlock, " its counts say"));
  }
  int64_t start = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t end = whole ? m : start + counts[i] * kBlock;
    for (int64_t b = start; b < end; b += kChunk) {
      chunks->push_back({b, std::min(end, b + kChunk), first + static_cast<int>(i)});
    }
    start = end;
  }
  return absl::OkStatus();
}

Status CheckSlice(const Tensor& a, const Tensor& b) {
  if (a.dims() != 1 || b.dims() != 1 || a.dim_size(0) != b.dim_size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("a and b must be vectors of one length; received shapes ",
                                                   a.shape().DebugString(), " and ", b.shape().DebugString()));
  }
  return absl::OkStatus();
}

void RunChunks(OpKernelContext* context, int64_t num_chunks, const std::function<void(int64_t, int64_t)>& work) {
  const auto* threads = context->device()->tensorflow_cpu_worker_threads();
  // Cost per chunk, in TF's units (about one cycle): a few per element.
  tensorflow::Shard(threads->num_threads, threads->workers, num_chunks, 4 * kChunk, work);
}

class SliceOp : public OpKernel {
 public:
  explicit SliceOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("first", &first_));
    OP_REQUIRES_OK(context, context->GetAttr("counts", &counts_));
    OP_REQUIRES_OK(context, context->GetAttr("num_tensors", &num_tensors_));
  }

 protected:
  int first_;
  std::vector<int> counts_;
  int num_tensors_;
};

template <typename T>
class PartialDotsOp : public SliceOp {
 public:
  using SliceOp::SliceOp;

  void Compute(OpKernelContext* context) override {
    const Tensor& a_in = context->input(0);
    const Tensor& b_in = context->input(1);
    OP_REQUIRES_OK(context, CheckSlice(a_in, b_in));
    const int64_t m = a_in.dim_size(0);
    std::vector<Chunk> chunks;
    OP_REQUIRES_OK(context, MakeChunks(m, first_, counts_, num_tensors_, &chunks));
    const T* a = a_in.flat<T>().data();
    const T* b = b_in.flat<T>().data();
    std::vector<double> sums(3 * chunks.size(), 0.0);
    RunChunks(context, chunks.size(), [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        Dots(a + chunks[c].begin, b + chunks[c].begin, chunks[c].end - chunks[c].begin, &sums[3 * c]);
      }
    });
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({num_tensors_, 3}), &out));
    double* totals = out->flat<double>().data();
    std::fill(totals, totals + 3 * num_tensors_, 0.0);
    for (size_t c = 0; c < chunks.size(); ++c) {
      for (int k = 0; k < 3; ++k) totals[3 * chunks[c].tensor + k] += sums[3 * c + k];
    }
  }
};

template <typename T>
class ScaledSumOp : public SliceOp {
 public:
  using SliceOp::SliceOp;

  void Compute(OpKernelContext* context) override {
    const Tensor& a_in = context->input(0);
    const Tensor& b_in = context->input(1);
    const Tensor& c_a = context->input(2);
    const Tensor& c_b = context->input(3);
    OP_REQUIRES_OK(context, CheckSlice(a_in, b_in));
    OP_REQUIRES(context, c_a.NumElements() == num_tensors_ && c_b.NumElements() == num_tensors_,
                absl::InvalidArgumentError(absl::StrCat("c_a and c_b must have num_tensors=", num_tensors_,
                                                        " elements; received ", c_a.NumElements(), " and ",
                                                        c_b.NumElements())));
    const int64_t m = a_in.dim_size(0);
    std::vector<Chunk> chunks;
    OP_REQUIRES_OK(context, MakeChunks(m, first_, counts_, num_tensors_, &chunks));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({m}), &out));
    const T* a = a_in.flat<T>().data();
    const T* b = b_in.flat<T>().data();
    const double* ca = c_a.flat<double>().data();
    const double* cb = c_b.flat<double>().data();
    T* result = out->flat<T>().data();
    RunChunks(context, chunks.size(), [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const Chunk& chunk = chunks[c];
        ScaledSum(a + chunk.begin, b + chunk.begin, result + chunk.begin, chunk.end - chunk.begin,
                  ca[chunk.tensor], cb[chunk.tensor]);
      }
    });
  }
};

// out = in * s over n elements; returns whether all of out is finite.
// (v - v is +0 for a finite v and NaN for an infinity or a NaN.)
template <typename T>
__attribute__((always_inline)) inline bool ScaleCheckBody(const T* in, T* out, int64_t n, T s) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = in[i] * s;
    const double v = ToDouble(out[i]);
    acc += v - v;
  }
  return acc == 0.0;
}
template <>
__attribute__((always_inline)) inline bool ScaleCheckBody<float>(const float* in, float* out, int64_t n, float s) {
  typedef float V8f __attribute__((vector_size(32)));
  const V8f scale = {s, s, s, s, s, s, s, s};
  V8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V8f v;
    std::memcpy(&v, in + i, sizeof(v));
    v *= scale;
    std::memcpy(out + i, &v, sizeof(v));
    acc += v - v;
  }
  float tail = 0.0f;
  for (; i < n; ++i) {
    out[i] = in[i] * s;
    tail += out[i] - out[i];
  }
  for (int k = 0; k < 8; ++k) tail += acc[k];
  return tail == 0.0f;
}

template <typename T>
bool ScaleCheckGeneric(const T* in, T* out, int64_t n, T s) {
  return ScaleCheckBody(in, out, n, s);
}
#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx2"))) bool ScaleCheckAvx2(const T* in, T* out, int64_t n, T s) {
  return ScaleCheckBody(in, out, n, s);
}
#endif

template <typename T>
bool ScaleCheck(const T* in, T* out, int64_t n, T s) {
#if defined(__x86_64__)
  if (HasAvx2()) return ScaleCheckAvx2(in, out, n, s);
#endif
  return ScaleCheckGeneric(in, out, n, s);
}

// y = x * scale in T (as tf.multiply rounds it), and whether every element
// of y is finite, in one pass.
template <typename T>
class ScaleAndCheckOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    const Tensor& x = context->input(0);
    const Tensor& scale = context->input(1);
    OP_REQUIRES(context, scale.NumElements() == 1,
                absl::InvalidArgumentError(absl::StrCat("scale must be a scalar; received shape ",
                                                        scale.shape().DebugString())));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    Tensor* finite = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(1, TensorShape({}), &finite));
    const T s = scale.flat<T>()(0);
    const T* in = x.flat<T>().data();
    T* out = y->flat<T>().data();
    const int64_t n = x.NumElements();
    const int64_t num_chunks = (n + kChunk - 1) / kChunk;
    std::vector<char> chunk_finite(num_chunks, 1);
    RunChunks(context, num_chunks, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
        chunk_finite[c] = ScaleCheck(in + begin, out + begin, end - begin, s);
      }
    });
    finite->scalar<bool>()() = std::all_of(chunk_finite.begin(), chunk_finite.end(), [](char ok) { return ok; });
  }
};

// ---------------------------------------------------------------------------
// The compressed wire's encoder and decoder.

#include "adasum_compression.h"

// a and b must be vectors of one length; `length` is that length.
Status CheckSliceShape(::tensorflow::shape_inference::InferenceContext* c,
                       ::tensorflow::shape_inference::DimensionHandle* length) {
  ::tensorflow::shape_inference::ShapeHandle a, b;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &a));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &b));
  return c->Merge(c->Dim(a, 0), c->Dim(b, 0), length);
}

}  // namespace

REGISTER_OP("TfAdasumPartialDots")
    .Input("a: T")
    .Input("b: T")
    .Output("sums: float64")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("first: int >= 0")
    .Attr("counts: list(int)")
    .Attr("num_tensors: int >= 1")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::DimensionHandle length;
      TF_RETURN_IF_ERROR(CheckSliceShape(c, &length));
      int num_tensors;
      TF_RETURN_IF_ERROR(c->GetAttr("num_tensors", &num_tensors));
      c->set_output(0, c->Matrix(num_tensors, 3));
      return absl::OkStatus();
    })
    .Doc("Per tensor [a.b, |a|^2, |b|^2] in float64 over the same slice a, b of two fused buffers.");

REGISTER_OP("TfAdasumScaledSum")
    .Input("a: T")
    .Input("b: T")
    .Input("c_a: float64")
    .Input("c_b: float64")
    .Output("out: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("first: int >= 0")
    .Attr("counts: list(int)")
    .Attr("num_tensors: int >= 1")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::DimensionHandle length;
      TF_RETURN_IF_ERROR(CheckSliceShape(c, &length));
      c->set_output(0, c->Vector(length));
      return absl::OkStatus();
    })
    .Doc("c_a[t] * a + c_b[t] * b per tensor t in float64, cast to T, over the same slice a, b of two buffers.");

REGISTER_OP("TfAdasumScaleAndCheck")
    .Input("x: T")
    .Input("scale: T")
    .Output("y: T")
    .Output("all_finite: bool")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle scale;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &scale));
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("y = x * scale (in T), and whether every element of y is finite.");

REGISTER_OP("TfAdasumEncodeBlocks")
    .Input("rows: T")
    .Output("packed: W")
    .Attr("T: {float, double}")
    .Attr("W: {half, bfloat16}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      ::tensorflow::shape_inference::DimensionHandle blocks, packed;
      TF_RETURN_IF_ERROR(c->Divide(c->Dim(rows, 1), kBlock, /*evenly_divisible=*/true, &blocks));
      TF_RETURN_IF_ERROR(c->Multiply(blocks, kPacked, &packed));
      c->set_output(0, c->Matrix(c->Dim(rows, 0), packed));
      return absl::OkStatus();
    })
    .Doc("Rows of 128-element blocks in the compressed wire format (tf_adasum.comm.compression).");

REGISTER_OP("TfAdasumDecodeBlocks")
    .Input("packed: W")
    .Output("rows: T")
    .Attr("W: {half, bfloat16}")
    .Attr("T: {float, double}")
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      ::tensorflow::shape_inference::ShapeHandle packed;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &packed));
      ::tensorflow::shape_inference::DimensionHandle blocks, length;
      TF_RETURN_IF_ERROR(c->Divide(c->Dim(packed, 1), kPacked, /*evenly_divisible=*/true, &blocks));
      TF_RETURN_IF_ERROR(c->Multiply(blocks, kBlock, &length));
      c->set_output(0, c->Matrix(c->Dim(packed, 0), length));
      return absl::OkStatus();
    })
    .Doc("The inverse of TfAdasumEncodeBlocks.");

#define TFA_REGISTER_WIRE_KERNELS(T, W)                                                                         \
  REGISTER_KERNEL_BUILDER(                                                                                     \
      Name("TfAdasumEncodeBlocks").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<W>("W"), \
      EncodeBlocksOp<T, W>);                                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                                     \
      Name("TfAdasumDecodeBlocks").Device(::tensorflow::DEVICE_CPU).TypeConstraint<W>("W").TypeConstraint<T>("T"), \
      DecodeBlocksOp<W, T>)
TFA_REGISTER_WIRE_KERNELS(float, Eigen::half);
TFA_REGISTER_WIRE_KERNELS(float, Eigen::bfloat16);
TFA_REGISTER_WIRE_KERNELS(double, Eigen::half);
TFA_REGISTER_WIRE_KERNELS(double, Eigen::bfloat16);

#define TFA_REGISTER_CPU_KERNELS(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TfAdasumPartialDots").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),          \
      PartialDotsOp<T>);                                                                             \
  REGISTER_KERNEL_BUILDER(Name("TfAdasumScaledSum").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          ScaledSumOp<T>);                                                           \
  REGISTER_KERNEL_BUILDER(                                                                           \
      Name("TfAdasumScaleAndCheck").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),        \
      ScaleAndCheckOp<T>)
TFA_REGISTER_CPU_KERNELS(Eigen::half);
TFA_REGISTER_CPU_KERNELS(Eigen::bfloat16);
TFA_REGISTER_CPU_KERNELS(float);
TFA_REGISTER_CPU_KERNELS(double);

}  // namespace tf_adasum
