"""tests/kernels/sass.py reads a listing as the GPU runs it: subroutines out, loops apart."""

from sass import ISSUE_PER_BYTE, cost

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x0 */
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;             /* 0x0 */
        /*0020*/                   LDG.E.U8 R8, desc[UR4][R2.64] ;              /* 0x0 */
        /*0030*/              @!P1 BRA 0x0060 ;                                 /* 0x0 */
        /*0040*/                   CALL.REL.NOINC 0x00c0 ;                      /* 0x0 */
        /*0050*/                   SHFL.BFLY PT, R6, R7, 0x1, 0x1f ;            /* 0x0 */
        /*0060*/                   FADD R4, R4, R5 ;                            /* 0x0 */
        /*0070*/               @P0 BRA 0x0060 ;                                 /* 0x0 */
        /*0080*/                   STG.E.64 desc[UR4][R2.64], R4 ;              /* 0x0 */
        /*0090*/                   EXIT ;                                       /* 0x0 */
        /*00a0*/                   BRA 0x00a0;                                  /* 0x0 */
        /*00b0*/                   NOP;                                         /* 0x0 */
        /*00c0*/                   MUFU.RCP R0, R1 ;                            /* 0x0 */
        /*00d0*/                   RET.REL.NODEC R44 0x0 ;                      /* 0x0 */
"""


def test_cost_counts_the_straight_line_and_the_loop_apart():
    c = cost(LISTING)
    assert (c.straight, c.loop_body) == (8, 2)  # 0000-0050, 0080, 0090 | 0060-0070
    assert c.families == {"SHFL": 1}  # the MUFU is in the subroutine
    assert dict(c.global_loads) == {128: 1, 8: 1} and dict(c.global_stores) == {64: 1}
    # 128 threads on 256 elements, the loop run 4 times: (8 + 4 * 2) / 2 per element
    assert c.per_element(128, 256, trips=4) == 8.0


def test_budget_is_the_h100_issue_rate_over_its_bandwidth():
    assert 12.4 < ISSUE_PER_BYTE < 12.6  # 132 SMs x 4 x 32 lanes x 1.98 GHz / (0.8 x 3.35 TB/s)
