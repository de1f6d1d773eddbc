// Adam/AdamW kernels: one pass over p, g, m, v (and an optional bf16/fp16 copy of p), with the
// moments stored as fp32, bf16 or 8-bit codes with per-block scales. This header picks the function
// for a combination of ISA, gradient dtype, copy dtype, L2 mode and moment format; the kernels live
// in adam_scalar.h, adam_avx2.h and adam_avx512.h. Each ISA's functions carry their own GCC target
// attribute, so one translation unit compiled for baseline x86-64 holds all of them.
#pragma once

#include "adam_avx2.h"
#include "adam_avx512.h"
#include "adam_scalar.h"

namespace infinity_adam {

template <Isa I, GradKind G, CopyKind C, bool L2, MomentKind M>
constexpr RangeFn range_fn() {
    if constexpr (I == Isa::avx512) return &range_avx512<G, C, L2, M>;
    else if constexpr (I == Isa::avx2) return &range_avx2<G, C, L2, M>;
    else return &range_scalar<G, C, L2, M>;
}

template <Isa I, GradKind G, CopyKind C, bool L2>
constexpr RangeFn pick_moments(MomentKind m) {
    switch (m) {
        case MomentKind::bf16: return range_fn<I, G, C, L2, MomentKind::bf16>();
        case MomentKind::q8: return range_fn<I, G, C, L2, MomentKind::q8>();
        default: return range_fn<I, G, C, L2, MomentKind::f32>();
    }
}

template <Isa I, GradKind G, CopyKind C>
constexpr RangeFn pick_l2(bool l2, MomentKind m) {
    return l2 ? pick_moments<I, G, C, true>(m) : pick_moments<I, G, C, false>(m);
}

template <Isa I, GradKind G>
constexpr RangeFn pick_copy(CopyKind c, bool l2, MomentKind m) {
    switch (c) {
        case CopyKind::bf16: return pick_l2<I, G, CopyKind::bf16>(l2, m);
        case CopyKind::f16: return pick_l2<I, G, CopyKind::f16>(l2, m);
        default: return pick_l2<I, G, CopyKind::none>(l2, m);
    }
}

template <Isa I>
constexpr RangeFn pick_grad(GradKind g, CopyKind c, bool l2, MomentKind m) {
    switch (g) {
        case GradKind::bf16: return pick_copy<I, GradKind::bf16>(c, l2, m);
        case GradKind::f16: return pick_copy<I, GradKind::f16>(c, l2, m);
        default: return pick_copy<I, GradKind::f32>(c, l2, m);
    }
}

inline RangeFn pick_range_fn(Isa isa, GradKind g, CopyKind c, bool l2, MomentKind m) {
    switch (isa) {
        case Isa::avx512: return pick_grad<Isa::avx512>(g, c, l2, m);
        case Isa::avx2: return pick_grad<Isa::avx2>(g, c, l2, m);
        default: return pick_grad<Isa::scalar>(g, c, l2, m);
    }
}

}  // namespace infinity_adam
