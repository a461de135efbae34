// The kernels of tf_adasum's compressed wire (tf_adasum/comm/compression.py):
// TfAdasumEncodeBlocks and TfAdasumDecodeBlocks, bitwise its TensorFlow ops,
// registered in adasum_cpu_ops.cc.
//
// Included inside adasum_cpu_ops.cc's anonymous namespace, after kBlock,
// kChunk and RunChunks.

#ifndef TF_ADASUM_NATIVE_ADASUM_COMPRESSION_H_
#define TF_ADASUM_NATIVE_ADASUM_COMPRESSION_H_

// The compressed wire of tf_adasum/comm/compression.py, one pass per block
// (the same arithmetic as its TensorFlow ops: the same Eigen conversions,
// float64 scaling by exact powers of two). A row of blocks of kBlock values
// becomes, per block, its kBlock values scaled by 2^-e and rounded to W, then
// e as an int32 in two W slots (low half first). e puts the block's peak
// magnitude, once rounded to W, in [2^13, 2^14); e = 0 for a block whose
// peak is 0 or not finite.
constexpr int64_t kPacked = kBlock + 2;
constexpr int64_t kPeakExponent = 13;
constexpr int64_t kMaxExponent = 1022;

inline double PowerOfTwo(int64_t e) {  // 2^e for e in [-1022, 1022], exactly
  const uint64_t bits = static_cast<uint64_t>(e + 1023) << 52;
  double out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline int64_t FloorLog2(double x) {  // of a positive double: its exponent bits
  int64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits >> 52) - 1023;
}

inline int64_t Clamped(int64_t e) { return std::min(kMaxExponent, std::max(-kMaxExponent, e)); }

template <typename T, typename W>
void EncodeBlock(const T* in, W* out) {
  double peak = 0.0;
  bool finite = true;
  for (int64_t i = 0; i < kBlock; ++i) {
    const double v = std::abs(static_cast<double>(in[i]));
    finite = finite && std::isfinite(v);
    peak = std::max(peak, v);
  }
  int64_t e = 0;
  if (finite && peak > 0.0) {
    e = Clamped(FloorLog2(peak) - kPeakExponent);
    const double rounded_peak = static_cast<double>(static_cast<float>(W(peak * PowerOfTwo(-e))));
    e = Clamped(e + (rounded_peak >= static_cast<double>(int64_t{1} << (kPeakExponent + 1)) ? 1 : 0));
  }
  const double scale = PowerOfTwo(-e);
  for (int64_t i = 0; i < kBlock; ++i) out[i] = W(static_cast<double>(in[i]) * scale);
  const int32_t exponent = static_cast<int32_t>(e);
  std::memcpy(static_cast<void*>(out + kBlock), &exponent, sizeof(exponent));
}

template <typename W, typename T>
void DecodeBlock(const W* in, T* out) {
  int32_t exponent;
  std::memcpy(&exponent, in + kBlock, sizeof(exponent));
  const double scale = PowerOfTwo(exponent);
  for (int64_t i = 0; i < kBlock; ++i) out[i] = static_cast<T>(static_cast<double>(static_cast<float>(in[i])) * scale);
}

// work(b) for each of `blocks` blocks, kChunk / kBlock blocks per unit of work.
template <typename Work>
void RunBlocks(OpKernelContext* context, int64_t blocks, const Work& work) {
  constexpr int64_t kPerChunk = kChunk / kBlock;
  RunChunks(context, (blocks + kPerChunk - 1) / kPerChunk, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo * kPerChunk; b < std::min(blocks, hi * kPerChunk); ++b) work(b);
  });
}

// [r, m] T (m a multiple of kBlock) -> [r, m / kBlock * kPacked] W.
template <typename T, typename W>
class EncodeBlocksOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    const Tensor& rows = context->input(0);
    OP_REQUIRES(context, rows.dims() == 2 && rows.dim_size(1) % kBlock == 0,
                absl::InvalidArgumentError(absl::StrCat("rows must be [r, m] with m a multiple of ", kBlock,
                                                        "; received shape ", rows.shape().DebugString())));
    const int64_t blocks = rows.NumElements() / kBlock;
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({rows.dim_size(0), rows.dim_size(1) / kBlock * kPacked}), &packed));
    const T* in = rows.flat<T>().data();
    W* out = packed->flat<W>().data();
    RunBlocks(context, blocks, [&](int64_t b) { EncodeBlock(in + b * kBlock, out + b * kPacked); });
  }
};

// [r, blocks * kPacked] W -> [r, blocks * kBlock] T.
template <typename W, typename T>
class DecodeBlocksOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* context) override {
    const Tensor& packed = context->input(0);
    OP_REQUIRES(context, packed.dims() == 2 && packed.dim_size(1) % kPacked == 0,
                absl::InvalidArgumentError(absl::StrCat("packed must be [r, n] with n a multiple of ", kPacked,
                                                        "; received shape ", packed.shape().DebugString())));
    const int64_t blocks = packed.NumElements() / kPacked;
    Tensor* rows = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(
                                0, TensorShape({packed.dim_size(0), packed.dim_size(1) / kPacked * kBlock}), &rows));
    const W* in = packed.flat<W>().data();
    T* out = rows->flat<T>().data();
    RunBlocks(context, blocks, [&](int64_t b) { DecodeBlock(in + b * kPacked, out + b * kBlock); });
  }
};

#endif  // TF_ADASUM_NATIVE_ADASUM_COMPRESSION_H_
