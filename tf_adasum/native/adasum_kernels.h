// Arithmetic kernels shared by tf_adasum's native op libraries
// (adasum_cpu_ops.cc, adasum_mpi_ops.cc): the float64-accumulated partial dot
// products and the scaled sum of tf_adasum/ops.py, on contiguous ranges.
//
// Included inside each library's own anonymous namespace (every library
// carries its own copy; nothing here is exported), after <cstdint>,
// <cstring> and TensorFlow's framework headers at global scope.
//
// Elements are cast to double before they are multiplied; sums accumulate in
// double. Vectorised with GCC vector extensions, and compiled a second time
// for AVX2 on x86_64 (chosen at run time, so a library runs on any x86_64).
// No FMA contraction (-ffp-contract=off), so c_a * a + c_b * b rounds as
// written.

#ifndef TF_ADASUM_NATIVE_ADASUM_KERNELS_H_
#define TF_ADASUM_NATIVE_ADASUM_KERNELS_H_

typedef double V4d __attribute__((vector_size(32)));
typedef float V4f __attribute__((vector_size(16)));
typedef uint16_t V4u16 __attribute__((vector_size(8)));
typedef uint32_t V4u32 __attribute__((vector_size(16)));

template <typename T>
__attribute__((always_inline)) inline V4d Load4(const T* p) {
  return V4d{static_cast<double>(static_cast<float>(p[0])), static_cast<double>(static_cast<float>(p[1])),
             static_cast<double>(static_cast<float>(p[2])), static_cast<double>(static_cast<float>(p[3]))};
}
template <>
__attribute__((always_inline)) inline V4d Load4<double>(const double* p) {
  V4d v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <>
__attribute__((always_inline)) inline V4d Load4<float>(const float* p) {
  V4f v;
  std::memcpy(&v, p, sizeof(v));
  return __builtin_convertvector(v, V4d);
}
template <>
__attribute__((always_inline)) inline V4d Load4<Eigen::bfloat16>(const Eigen::bfloat16* p) {
  V4u16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const V4u32 wide = __builtin_convertvector(bits, V4u32) << 16;  // bfloat16 is float's upper half
  V4f v;
  std::memcpy(&v, &wide, sizeof(v));
  return __builtin_convertvector(v, V4d);
}

template <typename T>
__attribute__((always_inline)) inline double ToDouble(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
__attribute__((always_inline)) inline double ToDouble<double>(double x) {
  return x;
}

// double -> T as tf.cast rounds it (Eigen: half and bfloat16 via float).
template <typename T>
__attribute__((always_inline)) inline T FromDouble(double x) {
  return T(static_cast<float>(x));
}
template <>
__attribute__((always_inline)) inline double FromDouble<double>(double x) {
  return x;
}
template <>
__attribute__((always_inline)) inline float FromDouble<float>(double x) {
  return static_cast<float>(x);
}

template <typename T>
__attribute__((always_inline)) inline void Store4(T* out, V4d v) {
  for (int i = 0; i < 4; ++i) out[i] = FromDouble<T>(v[i]);
}
template <>
__attribute__((always_inline)) inline void Store4<double>(double* out, V4d v) {
  std::memcpy(out, &v, sizeof(v));
}
template <>
__attribute__((always_inline)) inline void Store4<float>(float* out, V4d v) {
  const V4f f = __builtin_convertvector(v, V4f);
  std::memcpy(out, &f, sizeof(f));
}

// sums[0..2] += [a.b, |a|^2, |b|^2] over n elements.
template <typename T>
__attribute__((always_inline)) inline void DotsBody(const T* a, const T* b, int64_t n, double* sums) {
  V4d ab0 = {0, 0, 0, 0}, aa0 = ab0, bb0 = ab0, ab1 = ab0, aa1 = ab0, bb1 = ab0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const V4d a0 = Load4(a + i), b0 = Load4(b + i), a1 = Load4(a + i + 4), b1 = Load4(b + i + 4);
    ab0 += a0 * b0;
    aa0 += a0 * a0;
    bb0 += b0 * b0;
    ab1 += a1 * b1;
    aa1 += a1 * a1;
    bb1 += b1 * b1;
  }
  const V4d ab = ab0 + ab1, aa = aa0 + aa1, bb = bb0 + bb1;
  double dot = (ab[0] + ab[1]) + (ab[2] + ab[3]);
  double a_sq = (aa[0] + aa[1]) + (aa[2] + aa[3]);
  double b_sq = (bb[0] + bb[1]) + (bb[2] + bb[3]);
  for (; i < n; ++i) {
    const double x = ToDouble(a[i]), y = ToDouble(b[i]);
    dot += x * y;
    a_sq += x * x;
    b_sq += y * y;
  }
  sums[0] += dot;
  sums[1] += a_sq;
  sums[2] += b_sq;
}

// out = T(c_a * a + c_b * b), elementwise (out may be a or b).
template <typename T>
__attribute__((always_inline)) inline void ScaledSumBody(const T* a, const T* b, T* out, int64_t n, double c_a,
                                                         double c_b) {
  const V4d ca = {c_a, c_a, c_a, c_a}, cb = {c_b, c_b, c_b, c_b};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) Store4(out + i, ca * Load4(a + i) + cb * Load4(b + i));
  for (; i < n; ++i) out[i] = FromDouble<T>(c_a * ToDouble(a[i]) + c_b * ToDouble(b[i]));
}

template <typename T>
void DotsGeneric(const T* a, const T* b, int64_t n, double* sums) {
  DotsBody(a, b, n, sums);
}
template <typename T>
void ScaledSumGeneric(const T* a, const T* b, T* out, int64_t n, double c_a, double c_b) {
  ScaledSumBody(a, b, out, n, c_a, c_b);
}

#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx2"))) void DotsAvx2(const T* a, const T* b, int64_t n, double* sums) {
  DotsBody(a, b, n, sums);
}
template <typename T>
__attribute__((target("avx2"))) void ScaledSumAvx2(const T* a, const T* b, T* out, int64_t n, double c_a,
                                                   double c_b) {
  ScaledSumBody(a, b, out, n, c_a, c_b);
}

bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}
#endif

template <typename T>
void Dots(const T* a, const T* b, int64_t n, double* sums) {
#if defined(__x86_64__)
  if (HasAvx2()) return DotsAvx2(a, b, n, sums);
#endif
  DotsGeneric(a, b, n, sums);
}

template <typename T>
void ScaledSum(const T* a, const T* b, T* out, int64_t n, double c_a, double c_b) {
#if defined(__x86_64__)
  if (HasAvx2()) return ScaledSumAvx2(a, b, out, n, c_a, c_b);
#endif
  ScaledSumGeneric(a, b, out, n, c_a, c_b);
}

// out = a + b in T (Eigen's half and bfloat16 add via float and round, as TF).
template <typename T>
void Add(const T* a, const T* b, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

#endif  // TF_ADASUM_NATIVE_ADASUM_KERNELS_H_
