//! Writes a small bundle of random tensors (one shared section, one MoE layer of FP16 expert blobs,
//! its INT4 draft, a config) to the given path: a seed for the fuzzer and a file to poke at.
//!
//! Usage: cargo run -p specter-format --example write_sample -- OUT.specter [SEED]

use std::path::PathBuf;

use specter_format::{
    BundleWriter, DType, Provenance, QuantInfo, Result, SectionKind, QUANT_GROUP,
};

/// A small deterministic generator, so the sample needs no dependency beyond the crate.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }

    fn f16s(&mut self, count: usize) -> Vec<u8> {
        (0..count)
            .flat_map(|_| {
                let v = (self.next() % 2001) as f32 / 1000.0 - 1.0;
                half::f16::from_f32(v).to_le_bytes()
            })
            .collect()
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(out) = args.next().map(PathBuf::from) else {
        eprintln!("usage: write_sample OUT.specter [SEED]");
        std::process::exit(2);
    };
    let seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut rng = SplitMix(seed);
    let (hidden, inter, experts) = (16u64, 8u64, 2u32);

    let mut w = BundleWriter::create(&out)?;
    w.begin_section("shared", SectionKind::Shared)?;
    w.write_tensor(
        "model.embed_tokens.weight",
        DType::F16,
        &[32, hidden],
        &rng.f16s(32 * hidden as usize),
    )?;
    w.write_tensor(
        "model.norm.weight",
        DType::F16,
        &[hidden],
        &rng.f16s(hidden as usize),
    )?;
    w.end_section()?;

    w.begin_section("experts.1", SectionKind::Experts { layer: 1 })?;
    for e in 0..experts {
        w.begin_expert(1, e)?;
        let n = (hidden * inter) as usize;
        for (proj, shape) in [
            ("gate_proj", [inter, hidden]),
            ("up_proj", [inter, hidden]),
            ("down_proj", [hidden, inter]),
        ] {
            let name = format!("model.layers.1.mlp.experts.{e}.{proj}.weight");
            w.write_tensor(&name, DType::F16, &shape, &rng.f16s(n))?;
        }
        w.end_expert()?;
    }
    w.end_section()?;

    w.begin_section("draft.1", SectionKind::Draft { layer: 1 })?;
    for e in 0..experts {
        let base = format!("draft.layers.1.experts.{e}");
        w.write_tensor(
            &format!("{base}.gate_up.qweight"),
            DType::U32,
            &[hidden / 8, 2 * inter],
            &rng.bytes((hidden / 8 * 2 * inter * 4) as usize),
        )?;
        w.write_tensor(
            &format!("{base}.gate_up.scales"),
            DType::F16,
            &[1, 2 * inter],
            &rng.f16s((2 * inter) as usize),
        )?;
    }
    w.end_section()?;

    w.begin_section("config.json", SectionKind::Config)?;
    let hyper = format!("{{\"hidden_size\":{hidden},\"moe_intermediate_size\":{inter},\"n_routed_experts\":{experts}}}");
    w.write_raw(hyper.as_bytes())?;
    w.end_section()?;

    let provenance = Provenance {
        tool: "write_sample".into(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        sources: Vec::new(),
        // RTN has no dampening, ordering or calibration to record.
        quant: QuantInfo {
            method: "rtn".into(),
            bits: 4,
            group_size: QUANT_GROUP,
            ..QuantInfo::unquantized()
        },
        notes: vec![format!("random sample, seed {seed}")],
    };
    let len = w.finish("sample", &hyper, provenance)?;
    println!("wrote {} ({len} bytes)", out.display());
    Ok(())
}
