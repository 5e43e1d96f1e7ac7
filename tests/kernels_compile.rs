//! Every kernel file compiles with NVRTC for each GPU generation Specter may run on, and the PTX
//! holds every kernel the host loads by name. This needs NVRTC (libnvrtc and the CUDA headers)
//! but no GPU, so a kernel that does not compile fails here rather than on the GPU machine.
//!
//! Without NVRTC the test says so and passes, unless `SPECTER_REQUIRE_NVRTC=1`: `.ci/run` installs
//! NVRTC from pip and runs it that way (`scripts/kernel-check.sh test`), so there it cannot skip.

use specter::backend::cuda::{
    compile_source, kernel_param_names, kernel_signatures, nvrtc_library_present, KernelSource,
    KERNELS,
};
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

/// The (module, kernel) pairs loaded by literal name outside the backend's typed table:
/// `.function("m", "k")` in the library's and the binaries' sources (the doctor's checks).
fn loaded_by_name() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "specter-run/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut pairs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read a source file");
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

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Each kernel entry of `ptx` with its parameters' types in order (`.u64`, `.u32`, `.f32`).
fn entry_params(ptx: &str) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in ptx.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            if let Some((name, params)) = current.take() {
                out.insert(name, params);
            }
            let name = rest.split('(').next().unwrap_or(rest).trim().to_string();
            current = Some((name, Vec::new()));
        } else if let Some((_, params)) = current.as_mut() {
            if let Some(rest) = line.strip_prefix(".param ") {
                params.push(rest.split_whitespace().next().unwrap_or("").to_string());
            } else if line.starts_with(')') || line.starts_with('{') {
                let (name, params) = current.take().expect("an entry");
                out.insert(name, params);
            }
        }
    }
    if let Some((name, params)) = current {
        out.insert(name, params);
    }
    out
}

/// Every `extern "C" __global__` kernel in kernels/ with its parameters' names, read from the
/// sources as written: a kernel a macro stamps out (`name##SUFFIX(`) is keyed by its base name
/// with `##`, and stands for the base name followed by nothing, `_1` or a number.
fn c_signatures() -> Vec<(String, Vec<String>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("kernels/").flatten() {
        let path = entry.path();
        if !path.extension().is_some_and(|e| e == "cu" || e == "cuh") {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .expect("read a kernel file")
            .replace("\\\n", "\n");
        for piece in text.split("extern \"C\" __global__ void").skip(1) {
            let mut rest = piece.trim_start();
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__(") {
                rest = bounds.split_once(')').map_or("", |(_, r)| r).trim_start();
            }
            let Some((name, params)) = rest.split_once('(') else {
                continue;
            };
            let name: String = name.split_whitespace().collect();
            let (mut depth, mut end) = (1, 0);
            for (i, c) in params.char_indices() {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            let names = params[..end]
                .split(',')
                .filter_map(|p| {
                    p.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .rfind(|w| !w.is_empty())
                        .map(str::to_string)
                })
                .collect();
            out.push((name, names));
        }
    }
    out
}

/// Whether `kernel` is the kernel `key` (from [`c_signatures`]) names.
fn is_kernel(key: &str, kernel: &str) -> bool {
    match key.split_once("##") {
        None => key == kernel,
        Some((base, _)) => kernel.strip_prefix(base).is_some_and(|suffix| {
            suffix.is_empty() || suffix == "_1" || suffix.chars().all(|c| c.is_ascii_digit())
        }),
    }
}

/// Where an argument struct's field is not its kernel's parameter name: `linear2_f16` takes its
/// first product as `linear_f16` does (the nested `LinearArgs`), under names of its own.
const RENAMED: &[(&str, &str, &str)] = &[
    ("linear2_f16", "w", "wa"),
    ("linear2_f16", "n", "na"),
    ("linear2_f16", "bias", "ba"),
    ("linear2_f16", "y", "ya"),
];

#[test]
fn every_argument_struct_names_its_kernels_parameters_in_order() {
    // NVRTC checks the types (every_kernel_compiles_for_each_architecture); the names catch two
    // parameters of one type in the wrong order, which the types cannot.
    let signatures = c_signatures();
    assert!(signatures.len() > 40, "{} kernels read", signatures.len());
    let mut checked = 0;
    for (kernels, names) in kernel_param_names() {
        for kernel in kernels {
            // A kernel written out by name is that kernel, whatever a macro's name could stand for.
            let exact: Vec<_> = signatures.iter().filter(|(key, _)| key == kernel).collect();
            let c: Vec<&(String, Vec<String>)> = if exact.is_empty() {
                signatures
                    .iter()
                    .filter(|(key, _)| is_kernel(key, kernel))
                    .collect()
            } else {
                exact
            };
            assert_eq!(c.len(), 1, "{kernel}: {} C signatures match", c.len());
            let expected: Vec<&str> = names
                .iter()
                .map(|&field| {
                    RENAMED
                        .iter()
                        .find(|(k, rust, _)| kernel.starts_with(k) && *rust == field)
                        .map_or(field, |&(_, _, c)| c)
                })
                .collect();
            assert_eq!(
                c[0].1, expected,
                "{kernel}: the C parameters (left) are not its argument struct's fields (right)"
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} kernels checked");
}

/// Whether NVRTC can be loaded; without it the tests say so and pass, unless
/// `SPECTER_REQUIRE_NVRTC=1`, where they fail.
fn nvrtc_here() -> bool {
    if nvrtc_library_present() {
        return true;
    }
    assert!(
        std::env::var("SPECTER_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "SPECTER_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded: install it \
         (scripts/kernel-check.sh env) or put its directory on LD_LIBRARY_PATH"
    );
    eprintln!("kernels_compile: NVRTC not found, nothing compiled");
    false
}

#[test]
fn every_kernel_compiles_for_each_architecture() {
    if !nvrtc_here() {
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
            // The weights' loads are non-coherent as shipped: SPX_READONLY does something (see
            // only_memory_no_kernel_writes_is_read_non_coherently).
            if *arch == "sm_90" && ["gemv_f16", "moe_int4", "moe_rows", "ops"].contains(&name) {
                assert!(
                    non_coherent_loads(&ptx).values().sum::<usize>() > 0,
                    "kernels/{name}.cu reads its weights by no non-coherent load: is \
                     SPX_READONLY empty?"
                );
            }
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
    // Every argument struct of the backend (src/backend/cuda/runtime/args.rs) against the
    // parameters of each of its kernels, as NVRTC compiled them.
    let mut params: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for kernel in KERNELS {
        let ptx = compile_source(kernel, "sm_90", None)
            .expect("compiled above")
            .ptx;
        params.extend(entry_params(&ptx));
    }
    let mut typed = 0;
    for (kernels, types) in kernel_signatures() {
        for name in kernels {
            let got = params.get(*name).unwrap_or_else(|| {
                panic!("the backend launches {name}, which no kernel file defines")
            });
            assert_eq!(
                got, &types,
                "{name}: its argument struct's types (right) are not the kernel's parameters (left)"
            );
            typed += 1;
        }
    }
    assert!(typed >= 40, "only {typed} kernels have argument structs");
    let loaded = loaded_by_name();
    assert!(
        !loaded.is_empty(),
        "no kernel found loaded by name: have the doctor's checks changed form?"
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

/// The `ld.global.nc` loads of each kernel in `ptx` that waits for the kernels before it
/// (`griddepcontrol.wait`: one the backend may launch while those still run), by kernel name;
/// kernels with none left out. A kernel without the wait is never launched that way.
fn non_coherent_loads(ptx: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    let mut kernel: Option<(String, usize, bool)> = None;
    let mut finish = |k: Option<(String, usize, bool)>| {
        if let Some((name, n, waits)) = k {
            if n > 0 && waits {
                counts.insert(name, n);
            }
        }
    };
    for line in ptx.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            let name = rest.split('(').next().unwrap_or(rest).trim().to_string();
            finish(kernel.replace((name, 0, false)));
        } else if let Some((_, n, waits)) = kernel.as_mut() {
            *n += usize::from(line.starts_with("ld.global.nc"));
            *waits |= line.starts_with("griddepcontrol.wait");
        }
    }
    finish(kernel);
    counts
}

/// Only memory no kernel writes (marked `SPX_READONLY` or read by `spx_ldg`, kernels/common.cuh)
/// is read through non-coherent loads: a kernel launched while the one before it still runs
/// (programmatic dependent launch) must not read that one's outputs that way. Compiled with
/// `SPX_AUDIT_NC`, where both marks are plain, no kernel may keep a non-coherent load (that the
/// marks make the weights' loads non-coherent as shipped, the test above checks).
#[test]
fn only_memory_no_kernel_writes_is_read_non_coherently() {
    if !nvrtc_here() {
        return;
    }
    let audited: Vec<KernelSource> = KERNELS
        .iter()
        .map(|kernel| KernelSource {
            source: Box::leak(
                format!("#define SPX_AUDIT_NC 1\n{}", kernel.source).into_boxed_str(),
            ),
            ptx: None,
            ptx_arch: None,
            ..*kernel
        })
        .collect();
    let results: Vec<(&str, BTreeMap<String, usize>)> = std::thread::scope(|scope| {
        let threads: Vec<_> = audited
            .iter()
            .map(|audit| {
                scope.spawn(move || {
                    let ptx = compile_source(audit, "sm_90", None)
                        .unwrap_or_else(|e| panic!("kernels/{}.cu: {e}", audit.name))
                        .ptx;
                    (audit.name, non_coherent_loads(&ptx))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("compile thread"))
            .collect()
    });
    let mut left = Vec::new();
    for (name, audit) in &results {
        for (kernel, n) in audit {
            left.push(format!(
                "kernels/{name}.cu: {kernel}: {n} non-coherent loads"
            ));
        }
    }
    assert!(
        left.is_empty(),
        "non-coherent loads of memory not marked SPX_READONLY (an activation, cache or plan \
         read through a `const __restrict__` pointer or __ldg?):\n{}",
        left.join("\n")
    );
}
