//! `doctor`'s report as text for a person.

use super::*;

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn opt_gib(bytes: Option<u64>) -> String {
    bytes.map(gib).unwrap_or_else(|| "unknown".to_string())
}

/// The report as the lines `specter-run doctor` prints.
pub fn render_text(report: &DoctorReport) -> String {
    let mut out = String::new();
    let s = &report.system;
    let _ = writeln!(out, "Specter doctor (specter {})", report.specter_version);
    let _ = writeln!(out);
    let _ = writeln!(out, "System");
    let kernel = s
        .kernel
        .as_deref()
        .map(|k| format!(", Linux {k}"))
        .unwrap_or_default();
    let _ = writeln!(out, "  OS                {}{kernel}, {}", s.os, s.arch);
    let model = s
        .cpu_model
        .as_deref()
        .map(|m| format!(" ({m})"))
        .unwrap_or_default();
    let _ = writeln!(out, "  CPU               {} cores{model}", s.cpu_cores);
    let _ = writeln!(
        out,
        "  RAM               {} total, {} available",
        opt_gib(s.ram_total_bytes),
        opt_gib(s.ram_available_bytes)
    );
    let _ = writeln!(
        out,
        "  Disk              {} free in {}",
        opt_gib(s.disk_free_bytes),
        s.work_dir
    );
    if !report.host_read.is_empty() {
        let reads: Vec<String> = report
            .host_read
            .iter()
            .map(|r| format!("{} threads {:.1}", r.threads, r.bytes_per_s / 1e9))
            .collect();
        let _ = writeln!(out, "  host read         {} GB/s", reads.join(", "));
        // Copies over the link and the host expert kernel both read host memory, so together
        // they are held to what it gives both at once.
        match &report.shared_read {
            Some(shared) => {
                let _ = writeln!(
                    out,
                    "  hybrid ceiling    {:.1} GB/s for copies and host experts together: the host expert kernel ({} threads) {:.1} while copies ran {:.1} (both read host memory)",
                    shared.total_bytes_per_s() / 1e9,
                    shared.threads,
                    shared.host_bytes_per_s / 1e9,
                    shared.link_bytes_per_s / 1e9
                );
            }
            None => {
                let fastest = report
                    .host_read
                    .iter()
                    .map(|r| r.bytes_per_s)
                    .fold(0.0, f64::max);
                let _ = writeln!(
                    out,
                    "  hybrid ceiling    about {:.1} GB/s for copies and host experts together (both read host memory; not measured together here: it needs a GPU)",
                    fastest / 1e9
                );
            }
        }
    }
    let _ = writeln!(out, "  host experts      {}", report.host_expert_path);
    let _ = writeln!(out);
    let _ = writeln!(out, "CUDA");
    let found = |b: bool| if b { "found" } else { "not found" };
    let _ = writeln!(
        out,
        "  driver library    {}",
        found(report.cuda_driver_library)
    );
    let _ = writeln!(out, "  NVRTC library     {}", found(report.nvrtc_library));
    match &report.gpu {
        Some(g) => {
            let _ = writeln!(
                out,
                "  driver            supports CUDA {}",
                g.driver_cuda_version
            );
            let _ = writeln!(
                out,
                "  GPU {}             {} ({} device(s) visible)",
                g.ordinal, g.name, g.device_count
            );
            let _ = writeln!(out, "  compute cap.      {}", g.compute_capability);
            let _ = writeln!(
                out,
                "  memory            {} total, {} free",
                gib(g.memory_total_bytes),
                gib(g.memory_free_bytes)
            );
        }
        None => {
            let _ = writeln!(out, "  GPU               none usable (see problems)");
        }
    }
    if let Some(k) = &report.kernels {
        let _ = writeln!(out);
        let _ = writeln!(out, "Kernels");
        let _ = writeln!(
            out,
            "  embedded PTX      {}",
            if k.embedded_ptx {
                "yes (built with nvcc)"
            } else {
                "no (compiled at run time)"
            }
        );
        let version = k.nvrtc_version.as_deref().unwrap_or("unknown");
        let nvrtc = match (k.nvrtc_compiles, k.nvrtc_compile_seconds) {
            (true, Some(t)) => format!(
                "works (version {version}, util.cu compiled in {:.0} ms)",
                t * 1e3
            ),
            (true, None) => format!("works (version {version})"),
            (false, _) => "does not work".to_string(),
        };
        let _ = writeln!(out, "  NVRTC             {nvrtc}");
        if let Some(from) = &k.runtime_kernels_from {
            let _ = writeln!(out, "  runtime kernels   from {from}");
        }
        let axpy = match k.axpy_max_abs_error {
            Some(e) => format!(
                "{} ({} random elements, max |error| {e:.2e})",
                if k.axpy_passed { "correct" } else { "WRONG" },
                k.axpy_elements
            ),
            None => "not run".to_string(),
        };
        let _ = writeln!(out, "  axpy_f16 test     {axpy}");
    }
    if report.gpu.is_some() {
        let _ = writeln!(out);
        let _ = writeln!(out, "Host copies");
        match &report.registered_mmap {
            Some(m) => {
                let _ = writeln!(
                    out,
                    "  registered mmap   {} ({} MiB registered in {:.1} ms, copied at {:.1} GB/s, checksum {})",
                    if m.passed { "works" } else { "BROKEN" },
                    m.bytes / MIB,
                    m.register_ms,
                    m.copy_gbps,
                    if m.passed { "matches" } else { "differs" }
                );
            }
            None => {
                let _ = writeln!(out, "  registered mmap   does not work (see problems)");
            }
        }
        if let Some(path) = report.host_copy_path {
            let _ = writeln!(out, "  copy path         {}", path.as_str());
        }
        if let Some(b) = &report.bandwidth {
            let list = |v: &[f64]| {
                v.iter()
                    .map(|x| format!("{x:.1}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                out,
                "  pinned H2D        {:.1} GB/s median ({} MiB in {} MiB chunks; runs: {})",
                b.pinned_median_gbps,
                b.bytes / MIB,
                b.chunk_bytes / MIB,
                list(&b.pinned_gbps)
            );
            let _ = writeln!(
                out,
                "  pageable H2D      {:.1} GB/s median (runs: {})",
                b.pageable_median_gbps,
                list(&b.pageable_gbps)
            );
            let _ = writeln!(
                out,
                "  data check        {}",
                if b.verified {
                    "bytes arrived intact"
                } else {
                    "MISMATCH"
                }
            );
        }
    }
    let _ = writeln!(out);
    if report.problems.is_empty() {
        let _ = writeln!(
            out,
            "No problems found: the driver, NVRTC kernels and the host copy path all work here."
        );
    } else {
        let _ = writeln!(out, "Problems ({})", report.problems.len());
        for p in &report.problems {
            let _ = writeln!(out, "  - {}", p.what);
            let _ = writeln!(out, "    fix: {}", p.fix);
        }
        if !report.cuda_ready() {
            let _ = writeln!(out);
            let _ = writeln!(out, "CUDA cannot be used here; --backend cpu still works.");
        }
    }
    out
}
