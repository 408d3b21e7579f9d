/* The tile instructions as the AMX tiles name them (CYF_T_*), on the
 * hardware or on amx.h's model (CYF_AMX_MODEL 1).  No include guard: a
 * file that compiles an AMX tile both ways includes this before each.
 *
 * The hardware's are inline assembly (AT&T operand order) rather than the
 * compilers' _tile_* macros: each says it touches memory, so the compiler
 * neither drops the configuration's stores nor moves the reads of stored
 * sums across the tile stores.  Any assembler from binutils 2.36 or LLVM 12
 * on knows them; they run only where cyf_cpu_features found AMX and the OS
 * granted its state (cyformer._runtime).  CYF_T_END's model form turns a
 * fault the hardware would raise into NaN outputs (acc, n floats). */
#undef CYF_T_STATE
#undef CYF_T_CFG
#undef CYF_T_ZERO
#undef CYF_T_LOAD
#undef CYF_T_STORE
#undef CYF_T_DPBSUD
#undef CYF_T_DPBF16PS
#undef CYF_T_END
#if CYF_AMX_MODEL
#define CYF_T_STATE cyf_amx_model cyf_m_;
#define CYF_T_CFG(cfg) cyf_amx_model_cfg(&cyf_m_, cfg)
#define CYF_T_ZERO(t) cyf_amx_model_zero(&cyf_m_, t)
#define CYF_T_LOAD(t, base, stride) cyf_amx_model_load(&cyf_m_, t, base, stride)
#define CYF_T_STORE(t, base, stride) cyf_amx_model_store(&cyf_m_, t, base, stride)
#define CYF_T_DPBSUD(c, a, b) cyf_amx_model_dpbsud(&cyf_m_, c, a, b)
#define CYF_T_DPBF16PS(c, a, b) cyf_amx_model_dpbf16ps(&cyf_m_, c, a, b)
#define CYF_T_END(acc, n)                   \
    if (cyf_m_.bad)                         \
        for (ptrdiff_t i_ = 0; i_ < (n); i_++) \
            (acc)[i_] = __builtin_nanf("");
#else
#define CYF_T_STATE
#define CYF_T_CFG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const cyf_tilecfg *)(cfg)) : "memory")
#define CYF_T_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::: "memory")
#define CYF_T_LOAD(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((long)(stride)) : "memory")
#define CYF_T_STORE(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((long)(stride)) : "memory")
#define CYF_T_DPBSUD(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define CYF_T_DPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")
#define CYF_T_END(acc, n) __asm__ volatile("tilerelease" ::: "memory");
#endif
