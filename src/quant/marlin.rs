//! The Marlin tiled INT4 layout (group size 128), as read by the W4A16 kernel.
//!
//! docs/MARLIN.md defines the layout in full. In short, for code `q[r][c]` of a `[k][n]` matrix:
//! `tr = r / 16`, `rr = r % 16`, `b = c / 64`, `j = (c % 64) / 16`, `cc = c % 16`, and
//! `i = 4 * (cc % 8) + (rr % 8) / 2`; it lands in u32 `tr * 2n + 128 b + 4 i + j`, nibble
//! `4 (rr % 2) + 2 (cc / 8) + rr / 8` (nibble t occupies bits `4t..4t+4`). Scale `(g, c)` lands at
//! `g * n + 64 b + 8 (c % 8) + (c % 64) / 8`.

use half::f16;
use rayon::prelude::*;

use super::{
    check_marlin_shape, code_value, Bits, QuantMatrix, GROUP_SIZE, MARLIN_TILE_K, MARLIN_TILE_N,
};
use crate::{Error, Result};

/// u32 words one 16x64 block occupies (1024 codes, eight per word).
const BLOCK_WORDS: usize = MARLIN_TILE_K * MARLIN_TILE_N / 8;

/// Tile rows (of 16 input features) per quantization group.
const TILE_ROWS_PER_GROUP: usize = GROUP_SIZE / MARLIN_TILE_K;

/// Marlin-tiled storage of a [`QuantMatrix`].
///
/// `qweight` is row-major `[k / 16][n * 16 / 8]`: eight 4-bit codes per u32, the first code in the
/// least significant nibble. `scales` is `[k / 128][n]` f16 with each run of 64 scales permuted
/// (see [`scale_index`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MarlinWeight {
    pub k: usize,
    pub n: usize,
    pub qweight: Vec<u32>,
    pub scales: Vec<f16>,
}

impl MarlinWeight {
    /// The unpacked matrix (exact inverse of [`marlin_pack`]).
    pub fn unpack(&self) -> Result<QuantMatrix> {
        marlin_unpack(self.k, self.n, &self.qweight, &self.scales)
    }
}

/// For slot `8 w + t` of a 16x64 block (word `w` in `0..128`, nibble `t` in `0..8`): the block-local
/// row (`0..16`) and column (`0..64`) of the code stored there.
const fn slot_source(w: usize, t: usize) -> (usize, usize) {
    // The word's thread lane `i` and tile `j` within the block.
    let i = w / 4;
    let j = w % 4;
    let row = 8 * (t % 2) + 2 * (i % 4) + t / 4;
    let col_in_tile = 8 * ((t / 2) % 2) + i / 4;
    (row, 16 * j + col_in_tile)
}

/// `SLOT_SOURCE[8 w + t]` = (row, column) of the code in word `w`, nibble `t` of a block.
const SLOT_SOURCE: [(u8, u8); BLOCK_WORDS * 8] = {
    let mut table = [(0u8, 0u8); BLOCK_WORDS * 8];
    let mut s = 0;
    while s < BLOCK_WORDS * 8 {
        let (row, col) = slot_source(s / 8, s % 8);
        table[s] = (row as u8, col as u8);
        s += 1;
    }
    table
};

/// Where scale `(g, c)` is stored in a `[k / 128][n]` scale array of `n` columns: within each run
/// of 64 columns the position is transposed as an 8x8 grid (`c % 8` major).
#[inline(always)]
pub(crate) const fn scale_index(n: usize, g: usize, c: usize) -> usize {
    let local = c % MARLIN_TILE_N;
    g * n + (c - local) + 8 * (local % 8) + local / 8
}

fn check_lengths(what: &str, k: usize, n: usize, words: usize, scales: usize) -> Result<()> {
    check_marlin_shape(what, k, n)?;
    let want_words = k / MARLIN_TILE_K * n * 2;
    if words != want_words {
        return Err(Error::Quant(format!(
            "{what}: {words} packed words for k={k} n={n} (expected {want_words})"
        )));
    }
    let want_scales = k / GROUP_SIZE * n;
    if scales != want_scales {
        return Err(Error::Quant(format!(
            "{what}: {scales} scales for k={k} n={n} (expected {want_scales})"
        )));
    }
    Ok(())
}

/// Packs a 4-bit quantized matrix into the Marlin layout. Requires `k % 128 == 0` and
/// `n % 64 == 0`.
pub fn marlin_pack(m: &QuantMatrix) -> Result<MarlinWeight> {
    let (k, n) = (m.k, m.n);
    check_marlin_shape("marlin_pack", k, n)?;
    m.validate("marlin_pack")?;
    if m.bits != Bits::FOUR {
        return Err(Error::Quant(format!(
            "marlin_pack: the Marlin layout holds 4-bit codes, not {}-bit",
            m.bits
        )));
    }
    let row_words = 2 * n;
    let mut qweight = vec![0u32; k / MARLIN_TILE_K * row_words];
    qweight
        .par_chunks_exact_mut(row_words)
        .enumerate()
        .for_each(|(tr, words)| {
            let rows = &m.q[tr * MARLIN_TILE_K * n..(tr + 1) * MARLIN_TILE_K * n];
            for (b, block) in words.chunks_exact_mut(BLOCK_WORDS).enumerate() {
                let col0 = b * MARLIN_TILE_N;
                for (w, word) in block.iter_mut().enumerate() {
                    let mut v = 0u32;
                    for t in 0..8 {
                        let (row, col) = SLOT_SOURCE[8 * w + t];
                        let q = rows[usize::from(row) * n + col0 + usize::from(col)];
                        v |= u32::from(q & 0xF) << (4 * t);
                    }
                    *word = v;
                }
            }
        });
    let mut scales = vec![f16::ZERO; m.scales.len()];
    for g in 0..k / GROUP_SIZE {
        for c in 0..n {
            scales[scale_index(n, g, c)] = m.scales[g * n + c];
        }
    }
    Ok(MarlinWeight {
        k,
        n,
        qweight,
        scales,
    })
}

/// Unpacks Marlin-tiled storage (e.g. zero-copy views into a bundle) back to a [`QuantMatrix`];
/// the exact inverse of [`marlin_pack`]. Checks the shape rules and both buffer lengths.
pub fn marlin_unpack(k: usize, n: usize, qweight: &[u32], scales: &[f16]) -> Result<QuantMatrix> {
    check_lengths("marlin_unpack", k, n, qweight.len(), scales.len())?;
    let row_words = 2 * n;
    let mut q = vec![0u8; k * n];
    q.par_chunks_exact_mut(MARLIN_TILE_K * n)
        .zip(qweight.par_chunks_exact(row_words))
        .for_each(|(rows, words)| {
            for (b, block) in words.chunks_exact(BLOCK_WORDS).enumerate() {
                let col0 = b * MARLIN_TILE_N;
                for (w, &word) in block.iter().enumerate() {
                    for t in 0..8 {
                        let (row, col) = SLOT_SOURCE[8 * w + t];
                        rows[usize::from(row) * n + col0 + usize::from(col)] =
                            ((word >> (4 * t)) & 0xF) as u8;
                    }
                }
            }
        });
    let mut plain = vec![f16::ZERO; scales.len()];
    for g in 0..k / GROUP_SIZE {
        for c in 0..n {
            plain[g * n + c] = scales[scale_index(n, g, c)];
        }
    }
    Ok(QuantMatrix {
        k,
        n,
        bits: Bits::FOUR,
        q,
        scales: plain,
    })
}

/// Dequantizes Marlin-tiled storage straight to Hugging Face orientation `[n][k]` f32.
///
/// Equal to `marlin_unpack(..)?.dequantize_out_in()` without the intermediate matrices: each
/// 64-column block (64 output rows of the result) is decoded independently, in parallel.
pub fn marlin_dequantize_out_in(
    k: usize,
    n: usize,
    qweight: &[u32],
    scales: &[f16],
) -> Result<Vec<f32>> {
    check_lengths(
        "marlin_dequantize_out_in",
        k,
        n,
        qweight.len(),
        scales.len(),
    )?;
    let row_words = 2 * n;
    // Offset of each block slot inside a block's 64 output rows, relative to the tile row start.
    let slot_offset: Vec<u32> = SLOT_SOURCE
        .iter()
        .map(|&(row, col)| (usize::from(col) * k + usize::from(row)) as u32)
        .collect();
    let slot_col: Vec<u8> = SLOT_SOURCE.iter().map(|&(_, col)| col).collect();
    let mut out = vec![0.0f32; n * k];
    out.par_chunks_exact_mut(MARLIN_TILE_N * k)
        .enumerate()
        .for_each(|(b, block_out)| {
            let mut group_scales = [0.0f32; MARLIN_TILE_N];
            for tr in 0..k / MARLIN_TILE_K {
                if tr % TILE_ROWS_PER_GROUP == 0 {
                    let g = tr / TILE_ROWS_PER_GROUP;
                    for (col, s) in group_scales.iter_mut().enumerate() {
                        *s = scales[scale_index(n, g, b * MARLIN_TILE_N + col)].to_f32();
                    }
                }
                let words = &qweight[tr * row_words + b * BLOCK_WORDS..][..BLOCK_WORDS];
                let base = tr * MARLIN_TILE_K;
                for (w, &word) in words.iter().enumerate() {
                    for t in 0..8 {
                        let slot = 8 * w + t;
                        let code = ((word >> (4 * t)) & 0xF) as u8;
                        let s = group_scales[usize::from(slot_col[slot])];
                        block_out[slot_offset[slot] as usize + base] =
                            code_value(code, Bits::FOUR) * s;
                    }
                }
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_quant(rng: &mut ChaCha8Rng, k: usize, n: usize) -> QuantMatrix {
        QuantMatrix {
            k,
            n,
            bits: Bits::FOUR,
            q: (0..k * n).map(|_| rng.random_range(0..16u8)).collect(),
            scales: (0..k / GROUP_SIZE * n)
                .map(|_| f16::from_f32(rng.random_range(1e-4f32..0.1)))
                .collect(),
        }
    }

    /// The 16x64 block permutation, built the way the reference design describes it (docs/MARLIN.md
    /// "Construction"): a list of 1024 source positions in the tile-major row, each group of eight
    /// reordered by the interleave [0, 2, 4, 6, 1, 3, 5, 7], then inverted. Written independently
    /// of `slot_source`: returns, for block-local (row, col), the (word, nibble) it lands in.
    fn reference_block_destinations() -> Vec<Vec<(usize, usize)>> {
        let mut perm = Vec::with_capacity(1024);
        for lane in 0..32 {
            let col = lane / 4;
            let mut lane_sources = Vec::new();
            for half in 0..2 {
                for row in [
                    2 * (lane % 4),
                    2 * (lane % 4) + 1,
                    2 * (lane % 4) + 8,
                    2 * (lane % 4) + 9,
                ] {
                    lane_sources.push(16 * row + col + 8 * half);
                }
            }
            for tile in 0..4 {
                perm.extend(lane_sources.iter().map(|p| p + 256 * tile));
            }
        }
        let interleave = [0, 2, 4, 6, 1, 3, 5, 7];
        let perm: Vec<usize> = perm
            .chunks_exact(8)
            .flat_map(|g| interleave.iter().map(move |&x| g[x]))
            .collect();
        // perm[dest] = source position, where source position = 256 * tile + 16 * row + col_in_tile.
        let mut dest = vec![vec![(usize::MAX, usize::MAX); 64]; 16];
        for (d, &src) in perm.iter().enumerate() {
            let tile = src / 256;
            let row = (src % 256) / 16;
            let col = 16 * tile + src % 16;
            assert_eq!(dest[row][col].0, usize::MAX, "position reached twice");
            dest[row][col] = (d / 8, d % 8);
        }
        dest
    }

    #[test]
    fn pack_matches_independent_block_permutation() {
        let dest = reference_block_destinations();
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        // Three 16-row tile rows deep in k and two 64-column blocks, to check translation too.
        let (k, n) = (256, 128);
        let m = random_quant(&mut rng, k, n);
        let packed = marlin_pack(&m).unwrap();
        assert_eq!(packed.qweight.len(), k / 16 * n * 16 / 8);
        for r in 0..k {
            for c in 0..n {
                let (w, t) = dest[r % 16][c % 64];
                let word = (r / 16) * (2 * n) + (c / 64) * 128 + w;
                let got = (packed.qweight[word] >> (4 * t)) & 0xF;
                assert_eq!(got, u32::from(m.q[r * n + c]), "element ({r}, {c})");
            }
        }
        // A few hand-checked entries of the formula in docs/MARLIN.md.
        assert_eq!(dest[0][0], (0, 0));
        assert_eq!(dest[8][0], (0, 1));
        assert_eq!(dest[0][8], (0, 2));
        assert_eq!(dest[1][0], (0, 4));
        assert_eq!(dest[9][8], (0, 7));
        assert_eq!(dest[0][16], (1, 0));
        assert_eq!(dest[2][0], (4, 0));
        assert_eq!(dest[0][1], (16, 0));
        assert_eq!(dest[15][63], (127, 7));
    }

    #[test]
    fn scale_permutation_matches_reference() {
        // The reference's scale_perm: new position 8 i + j holds old position i + 8 j.
        let scale_perm: Vec<usize> = (0..8)
            .flat_map(|i| (0..8).map(move |j| i + 8 * j))
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let (k, n) = (256, 192);
        let m = random_quant(&mut rng, k, n);
        let packed = marlin_pack(&m).unwrap();
        // Reference: flatten [groups][n] row-major, permute each run of 64 by scale_perm.
        for (run, chunk) in m.scales.chunks_exact(64).enumerate() {
            for (p, &src) in scale_perm.iter().enumerate() {
                assert_eq!(packed.scales[run * 64 + p], chunk[src]);
            }
        }
    }

    #[test]
    fn round_trip_is_exact() {
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        for &(k, n) in &[(128, 64), (256, 128), (1408, 256), (128, 2816), (256, 192)] {
            let m = random_quant(&mut rng, k, n);
            let packed = marlin_pack(&m).unwrap();
            assert_eq!(packed.scales.len(), k / 128 * n);
            let back = marlin_unpack(k, n, &packed.qweight, &packed.scales).unwrap();
            assert_eq!(back, m, "k={k} n={n}");
            assert_eq!(packed.unpack().unwrap(), m);
        }
    }

    #[test]
    fn dequantize_from_tiles_equals_unpacked_dequantize() {
        let mut rng = ChaCha8Rng::seed_from_u64(24);
        for &(k, n) in &[(128, 64), (384, 128), (256, 320)] {
            let m = random_quant(&mut rng, k, n);
            let packed = marlin_pack(&m).unwrap();
            let direct = marlin_dequantize_out_in(k, n, &packed.qweight, &packed.scales).unwrap();
            assert_eq!(direct, m.dequantize_out_in(), "k={k} n={n}");
            // And the HF orientation is the transpose of [k][n].
            let kn = m.dequantize();
            for r in 0..k {
                for c in 0..n {
                    assert_eq!(direct[c * k + r], kn[r * n + c]);
                }
            }
        }
    }

    #[test]
    fn bad_shapes_and_lengths_are_named() {
        let mut rng = ChaCha8Rng::seed_from_u64(25);
        let m = random_quant(&mut rng, 128, 96);
        let msg = marlin_pack(&m).unwrap_err().to_string();
        assert!(
            msg.contains("n=96") && msg.contains("multiple of 64"),
            "{msg}"
        );

        let m = random_quant(&mut rng, 128, 64);
        let packed = marlin_pack(&m).unwrap();
        let msg = marlin_unpack(128, 64, &packed.qweight[1..], &packed.scales)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("packed words"), "{msg}");
        let msg = marlin_dequantize_out_in(128, 64, &packed.qweight, &packed.scales[1..])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("scales"), "{msg}");
        let msg = marlin_unpack(64, 64, &packed.qweight, &packed.scales)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("k=64"), "{msg}");

        let mut bad = m.clone();
        bad.q[3] = 16;
        assert!(marlin_pack(&bad).is_err());
    }

    #[test]
    fn concat_then_pack_keeps_both_halves() {
        let mut rng = ChaCha8Rng::seed_from_u64(26);
        let gate = random_quant(&mut rng, 256, 64);
        let up = random_quant(&mut rng, 256, 128);
        let fused = QuantMatrix::concat_n(&gate, &up).unwrap();
        assert_eq!((fused.k, fused.n), (256, 192));
        let packed = marlin_pack(&fused).unwrap();
        let deq = marlin_dequantize_out_in(256, 192, &packed.qweight, &packed.scales).unwrap();
        let mut expected = gate.dequantize_out_in();
        expected.extend(up.dequantize_out_in());
        assert_eq!(deq, expected);
        let other = random_quant(&mut rng, 128, 64);
        assert!(QuantMatrix::concat_n(&gate, &other).is_err());
    }
}
