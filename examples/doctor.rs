//! Prints what `specter-run doctor` reports: `cargo run --release --example doctor [-- --json]
//! [--device N] [--no-gpu] [--work-dir DIR]`.

use specter::doctor::{diagnose, render_text, DoctorOptions};
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut opts = DoctorOptions::default();
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--json" => json = true,
            "--no-gpu" => opts.gpu = false,
            "--device" => match args.next().and_then(|v| v.parse().ok()) {
                Some(n) => opts.device = n,
                None => return usage("--device needs a number"),
            },
            "--work-dir" => match args.next() {
                Some(dir) => opts.work_dir = PathBuf::from(dir),
                None => return usage("--work-dir needs a directory"),
            },
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    let report = diagnose(&opts);
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => println!("{text}"),
            Err(err) => {
                eprintln!("cannot serialise the report: {err}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        print!("{}", render_text(&report));
    }
    ExitCode::SUCCESS
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("{msg}\nusage: doctor [--json] [--device N] [--no-gpu] [--work-dir DIR]");
    ExitCode::from(2)
}
