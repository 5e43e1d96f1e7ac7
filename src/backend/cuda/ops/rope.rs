//! The rotary embedding's cos/sin tables: computed on the host for a pass's positions (the CPU
//! reference's code, so both backends rotate by the same values) and kept on the device.

use cudarc::driver::CudaSlice;

/// cos/sin of the last rope call's rows, kept on the device: every layer of one forward rotates
/// the same positions, so the table is uploaded once per forward.
pub(in crate::backend::cuda) struct RopeTableGpu {
    pub(in crate::backend::cuda) inv_freq: Vec<f32>,
    pub(in crate::backend::cuda) positions: Vec<usize>,
    pub(in crate::backend::cuda) scales: Vec<f32>,
    pub(in crate::backend::cuda) cos: CudaSlice<f32>,
    pub(in crate::backend::cuda) sin: CudaSlice<f32>,
}

/// Row-major `[positions, inv_freq]` cos and sin, scaled per row: as the CPU reference, the angle
/// rounded to f32, then cos/sin in f64.
pub(in crate::backend::cuda) fn rope_cos_sin(
    inv_freq: &[f32],
    positions: &[usize],
    scales: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0f32; positions.len() * half];
    let mut sin = vec![0.0f32; positions.len() * half];
    for (r, (&p, &s)) in positions.iter().zip(scales).enumerate() {
        for i in 0..half {
            let a = (inv_freq[i] * p as f32) as f64;
            cos[r * half + i] = (a.cos() as f32) * s;
            sin[r * half + i] = (a.sin() as f32) * s;
        }
    }
    (cos, sin)
}
