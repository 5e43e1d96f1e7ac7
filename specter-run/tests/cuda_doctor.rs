//! `doctor` on whatever machine runs the tests: system facts are always filled in, and a missing
//! driver is reported as a problem with a fix rather than an error or a panic. On a GPU machine
//! `gpu_doctor_checks_run` (ignored elsewhere, see tests/common/gpu.rs) checks the GPU half.

// The root crate's test helpers: fixtures (found from the repository root) and the GPU tests'
// convention.
#[path = "../../tests/common/mod.rs"]
mod common;

use specter::backend::cuda::{driver_library_present, NO_DRIVER_MESSAGE};
use specter_run::doctor::{diagnose, render_text, DoctorOptions};

fn small_options() -> DoctorOptions {
    DoctorOptions {
        mapping_bytes: 1 << 20,
        bandwidth_bytes: 4 << 20,
        chunk_bytes: 1 << 20,
        repeats: 1,
        ..DoctorOptions::default()
    }
}

#[test]
fn system_facts_are_reported() {
    let report = diagnose(&DoctorOptions {
        gpu: false,
        ..small_options()
    });
    let s = &report.system;
    assert!(s.cpu_cores >= 1);
    let (total, avail) = (
        s.ram_total_bytes.expect("MemTotal"),
        s.ram_available_bytes.expect("MemAvailable"),
    );
    assert!(
        total > 0 && avail <= total,
        "RAM {avail} available of {total}"
    );
    assert!(s.disk_free_bytes.is_some_and(|b| b > 0));
    assert!(
        report.gpu.is_none() && report.problems.is_empty(),
        "GPU checks were skipped: {:?}",
        report.problems
    );
    let text = render_text(&report);
    assert!(
        text.contains("cores") && text.contains("GiB total") && text.contains("No problems found"),
        "{text}"
    );
}

#[test]
fn driver_state_is_reported_with_fixes() {
    let report = diagnose(&small_options());
    let text = render_text(&report);
    let json = serde_json::to_value(&report).expect("report serialises");
    assert_eq!(
        json["cuda_driver_library"],
        serde_json::Value::Bool(driver_library_present())
    );
    let no_driver = report.problems.iter().find(|p| p.what == NO_DRIVER_MESSAGE);
    if driver_library_present() {
        // The GPU half of the report is checked by `gpu_doctor_checks_run` on a GPU machine.
        assert!(no_driver.is_none(), "a present driver reported missing");
        return;
    }
    assert!(report.gpu.is_none() && report.host_copy_path.is_none() && report.bandwidth.is_none());
    let p = no_driver.expect("no-driver problem listed");
    assert!(
        p.fix.contains("NVIDIA driver") && p.fix.contains("--backend cpu"),
        "{}",
        p.fix
    );
    assert!(
        text.contains(NO_DRIVER_MESSAGE) && text.contains("fix:"),
        "{text}"
    );
    assert!(!report.cuda_ready());
}

#[test]
#[ignore = "needs an NVIDIA GPU; run by scripts/gpu-check.sh"]
fn gpu_doctor_checks_run() {
    // Fails here, with the reason, when there is no usable GPU.
    drop(common::gpu::device());
    let report = diagnose(&small_options());
    let text = render_text(&report);
    let json = serde_json::to_value(&report).expect("report serialises");
    // The checks ran, a copy path was chosen, and the copies arrived intact.
    let gpu = report.gpu.as_ref().expect("GPU found");
    assert!(gpu.memory_total_bytes > 0 && !gpu.name.is_empty());
    let path = report.host_copy_path.expect("copy path chosen");
    assert_eq!(
        json["host_copy_path"],
        serde_json::Value::String(path.as_str().to_string())
    );
    assert!(report
        .bandwidth
        .as_ref()
        .is_some_and(|b| b.verified && b.pinned_median_gbps > 0.0));
    assert!(text.contains("copy path"), "{text}");
    // Host reads beside copies: both rates measured, and the ceiling line names them.
    let shared = report.shared_read.as_ref().expect("shared read measured");
    assert!(shared.host_bytes_per_s > 0.0 && shared.link_bytes_per_s > 0.0);
    let ceiling = text
        .lines()
        .find(|l| l.contains("hybrid ceiling"))
        .unwrap_or_else(|| panic!("no ceiling line in\n{text}"));
    assert!(ceiling.contains("while copies ran"), "{ceiling}");
}
