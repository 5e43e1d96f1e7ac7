//! Every kernel file compiles with NVRTC for each GPU generation Specter may run on, and the PTX
//! holds every kernel the host loads by name. This needs NVRTC (libnvrtc and the CUDA headers)
//! but no GPU, so a kernel that does not compile fails here rather than on the GPU machine.
//!
//! Without NVRTC the test says so and passes, unless `SPECTER_REQUIRE_NVRTC=1`: `.ci/run` installs
//! NVRTC from pip and runs it that way (`scripts/kernel-check.sh test`), so there it cannot skip.

use specter::backend::cuda::{compile_source, nvrtc_library_present, KERNELS};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The architectures compiled for: the A100 (the paper's GPU), Ada, Hopper (the H100 and the
/// H200 the benchmarks run on), and both Blackwell lines.
const ARCHS: &[&str] = &["sm_80", "sm_89", "sm_90", "sm_100", "sm_120"];

/// The kernel names of `.entry` lines in `ptx`.
fn entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix(".visible .entry ")?;
            Some(rest.split('(').next()?.trim().to_string())
        })
        .collect()
}

/// The (module, kernel) pairs the host loads by literal name: `dev.function("m", "k")` and the
/// `ops("k")` / `routing("k")` / `gemv("k")` helpers of src/backend/cuda/kernels.rs, plus the
/// doctor's.
fn loaded_by_name() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pairs = Vec::new();
    for file in ["src/backend/cuda/kernels.rs", "src/doctor/mod.rs"] {
        let text = std::fs::read_to_string(root.join(file)).expect(file);
        for (helper, module) in [
            ("ops(\"", "ops"),
            ("routing(\"", "routing"),
            ("gemv(\"", "gemv_f16"),
        ] {
            for piece in text.split(helper).skip(1) {
                if let Some(name) = piece.split('"').next() {
                    pairs.push((module.to_string(), name.to_string()));
                }
            }
        }
        // `.function("m", "k")`; the helpers' own `.function("m", f)` name no kernel.
        for piece in text.split(".function(\"").skip(1) {
            let Some((module, rest)) = piece.split_once('"') else {
                continue;
            };
            if let Some(name) = rest.strip_prefix(", \"").and_then(|r| r.split('"').next()) {
                pairs.push((module.to_string(), name.to_string()));
            }
        }
    }
    pairs
}

#[test]
fn every_kernel_compiles_for_each_architecture() {
    if !nvrtc_library_present() {
        assert!(
            std::env::var("SPECTER_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "SPECTER_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded: install it \
             (scripts/kernel-check.sh env) or put its directory on LD_LIBRARY_PATH"
        );
        eprintln!("kernels_compile: NVRTC not found, nothing compiled");
        return;
    }
    // One thread an architecture: NVRTC compiles separate programs concurrently.
    let compiled: Vec<Vec<_>> = std::thread::scope(|scope| {
        let threads: Vec<_> = ARCHS
            .iter()
            .map(|arch| {
                scope.spawn(move || {
                    KERNELS
                        .iter()
                        .map(|kernel| (kernel.name, compile_source(kernel, arch, None)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("compile thread"))
            .collect()
    });
    let failures: Vec<String> = ARCHS
        .iter()
        .zip(&compiled)
        .flat_map(|(arch, results)| {
            results
                .iter()
                .filter_map(move |(_, r)| r.as_ref().err().map(|e| format!("{arch}: {e}")))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "kernels that do not compile:\n{}",
        failures.join("\n")
    );
    // Per module: the entries of the first architecture, which every other one must match.
    let mut first: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for (arch, results) in ARCHS.iter().zip(compiled) {
        for (name, result) in results {
            let ptx = result.expect("checked above").ptx;
            let names = entries(&ptx);
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "kernels/{name}.cu: the PTX for {arch} names another target"
            );
            assert!(
                !names.is_empty(),
                "kernels/{name}.cu: no kernel in the PTX for {arch}"
            );
            match first.get(name) {
                None => {
                    first.insert(name, names);
                }
                Some(seen) => assert_eq!(
                    seen, &names,
                    "kernels/{name}.cu: {arch} gives other kernels than {}",
                    ARCHS[0]
                ),
            }
        }
    }
    let loaded = loaded_by_name();
    assert!(
        loaded.len() >= 30,
        "only {} kernels found loaded by name: has src/backend/cuda/kernels.rs changed form?",
        loaded.len()
    );
    for (module, name) in loaded {
        let names = first
            .get(module.as_str())
            .unwrap_or_else(|| panic!("the host loads module {module:?}, no kernel file has it"));
        assert!(
            names.contains(&name),
            "the host loads {name} from kernels/{module}.cu, which does not define it"
        );
    }
}
