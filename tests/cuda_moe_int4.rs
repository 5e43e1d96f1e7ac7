//! The grouped W4A16 expert kernels (kernels/moe_int4.cu) against a CPU f64 reference built from
//! the project's own quantizer and Marlin packer, and their batch invariance.
//!
//! Needs an NVIDIA GPU, so ignored by default (see tests/common/gpu.rs); `scripts/gpu-check.sh run
//! int4` runs these with `--ignored`.

mod common;
#[path = "common/moe_harness.rs"]
mod moe_harness;

use moe_harness::{assert_refused, random_weight, unlaunched, Family, Packed, Setup};
use rand_chacha::ChaCha8Rng;
use specter::backend::cuda::experts::MoeLaunch;
use specter::backend::cuda::{CudaStream, MoeInt4Kernels};
use specter::quant::{marlin_dequantize_out_in, marlin_pack, rtn, Bits, QuantMatrix};

/// The W4A16 kernels.
struct Int4(MoeInt4Kernels);

impl Family for Int4 {
    type Code = u32;

    fn make_expert(&self, rng: &mut ChaCha8Rng, hidden: usize, inter: usize) -> Packed<u32> {
        let gate = rtn(
            "gate",
            &random_weight(rng, inter, hidden),
            inter,
            hidden,
            Bits::FOUR,
        )
        .unwrap();
        let up = rtn(
            "up",
            &random_weight(rng, inter, hidden),
            inter,
            hidden,
            Bits::FOUR,
        )
        .unwrap();
        let gate_up = marlin_pack(&QuantMatrix::concat_n(&gate, &up).unwrap()).unwrap();
        let down = marlin_pack(
            &rtn(
                "down",
                &random_weight(rng, hidden, inter),
                hidden,
                inter,
                Bits::FOUR,
            )
            .unwrap(),
        )
        .unwrap();
        assert!(gate_up.qweight.iter().any(|&w| w != 0x8888_8888));
        Packed {
            gate_up_ref: marlin_dequantize_out_in(
                hidden,
                2 * inter,
                &gate_up.qweight,
                &gate_up.scales,
            )
            .unwrap(),
            down_ref: marlin_dequantize_out_in(inter, hidden, &down.qweight, &down.scales).unwrap(),
            gate_up: (gate_up.qweight, gate_up.scales),
            down: (down.qweight, down.scales),
        }
    }

    fn launch(&self, stream: &CudaStream, launch: &MoeLaunch) -> specter::Result<()> {
        self.0.launch(stream, launch)
    }

    fn label(&self) -> String {
        String::new()
    }
}

fn check_shape(hidden: usize, inter: usize, seed: u64) {
    let device = common::gpu::device();
    let kernels = MoeInt4Kernels::new(&device).expect("load the INT4 MoE kernels");
    // Uneven groups: one item, two chunks (17: 16 on two mma item tiles, then 1), an odd count, an
    // empty group, one full n8 tile, one full 16-item chunk, and a five.
    let counts = [1, 17, 3, 0, 8, 16, 5];
    let rows = 24;
    let setup = Setup::new(
        device,
        Int4(kernels),
        (hidden, inter),
        rows,
        counts.len(),
        seed,
    );
    // Alone, the 8-item kernel variant (one n8 tile); in the mixed launch, the 16-item variant:
    // the lone item, the last item of the 17 (second chunk), items of the second n8 tile of a
    // 16-item chunk, one of the odd group of 3, the last of the 8, and both ends of the 16.
    let alone = [
        (0usize, 0usize),
        (1, 16),
        (1, 9),
        (2, 1),
        (4, 7),
        (5, 0),
        (5, 15),
    ];
    // Each size alone: m <= 8 runs the 8-item variant.
    let sizes = [1usize, 3, 8, 16, 17];
    setup.batch_invariance(seed, &counts, &alone, &sizes);
    println!("hidden={hidden} inter={inter}: batch invariance holds (reordered, alone, per size)");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_small_shape() {
    check_shape(256, 128, 41);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_deepseek_v2_lite_shape() {
    check_shape(2048, 1408, 42);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn int4_moe_rejects_bad_shapes_before_launching() {
    let device = common::gpu::device();
    let kernels = MoeInt4Kernels::new(&device).expect("load the INT4 MoE kernels");
    let refused = kernels.launch(device.stream(), &unlaunched(1, 1400));
    assert_refused(refused, "inter=1400", "shape");
}
