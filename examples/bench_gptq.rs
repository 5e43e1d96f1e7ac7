//! Times GPTQ and the surrounding quantization steps on expert-sized shapes.
//!
//! `cargo run --release --example bench_gptq` (add `-- K N` to time one shape). The Hessians come
//! from random correlated activations (`X = Z A + noise`, 512 rows), so they are full rank but far
//! from diagonal, like real ones.

use std::error::Error;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specter_convert::quant::{
    gptq, marlin_dequantize_out_in, marlin_pack, output_rel_error, rtn, Bits, GptqConfig, Hessian,
};

fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
    let u2: f32 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn activations(rng: &mut ChaCha8Rng, rows: usize, k: usize) -> Vec<f32> {
    const WIDTH: usize = 64;
    let mix: Vec<f32> = (0..WIDTH * k).map(|_| normal(rng) / 8.0).collect();
    let mut x = vec![0.0f32; rows * k];
    for row in x.chunks_exact_mut(k) {
        let z: Vec<f32> = (0..WIDTH).map(|_| normal(rng)).collect();
        for (j, v) in row.iter_mut().enumerate() {
            *v = 0.3 * normal(rng)
                + z.iter()
                    .enumerate()
                    .map(|(t, zt)| zt * mix[t * k + j])
                    .sum::<f32>();
        }
    }
    x
}

fn bench(k: usize, n: usize) -> Result<(), Box<dyn Error>> {
    let mut rng = ChaCha8Rng::seed_from_u64((k * 31 + n) as u64);
    let rows = 512;
    let x = activations(&mut rng, rows, k);
    let w: Vec<f32> = (0..n * k).map(|_| 0.02 * normal(&mut rng)).collect();

    let t = Instant::now();
    let mut h = Hessian::new(k);
    h.add_rows(&x, rows);
    let t_hessian = t.elapsed();

    let t = Instant::now();
    let res = gptq("bench", &w, n, k, &h, &GptqConfig::default())?;
    let t_gptq = t.elapsed();

    let t = Instant::now();
    let base = rtn("bench", &w, n, k, Bits::FOUR)?;
    let t_rtn = t.elapsed();

    let t = Instant::now();
    let packed = marlin_pack(&res.q)?;
    let t_pack = t.elapsed();

    let t = Instant::now();
    let deq = marlin_dequantize_out_in(k, n, &packed.qweight, &packed.scales)?;
    let t_deq = t.elapsed();
    if deq.len() != n * k {
        return Err(format!("dequantized {} values, expected {}", deq.len(), n * k).into());
    }

    let e_gptq = output_rel_error(&w, &res.q, &x, rows);
    let e_rtn = output_rel_error(&w, &base, &x, rows);
    println!(
        "k={k:5} n={n:5}: hessian({rows} rows) {:7.1} ms | gptq {:7.1} ms | rtn {:6.1} ms | \
         marlin_pack {:5.1} ms | marlin_dequantize_out_in {:5.1} ms | rel err gptq {e_gptq:.4} \
         rtn {e_rtn:.4}",
        t_hessian.as_secs_f64() * 1e3,
        t_gptq.as_secs_f64() * 1e3,
        t_rtn.as_secs_f64() * 1e3,
        t_pack.as_secs_f64() * 1e3,
        t_deq.as_secs_f64() * 1e3,
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    println!("rayon threads: {}", rayon::current_num_threads());
    match args.as_slice() {
        [k, n] => bench(*k, *n)?,
        [] => {
            // Fused gate+up of a 2048-wide model with 1408-wide experts, and its down projection.
            bench(2048, 2816)?;
            bench(1408, 2048)?;
        }
        _ => return Err("usage: bench_gptq [K N]".into()),
    }
    Ok(())
}
