//! The host path's settings (`--host-experts`, `--host-threads`, `--link-gbps`) refuse impossible
//! values with a clear error and a non-zero exit, before any bundle is read.

#[path = "../../specter-pack/tests/common/cli.rs"]
mod cli;

use cli::assert_clean_failure;

fn specter_run(args: &[&str]) -> cli::Run {
    cli::run(env!("CARGO_BIN_EXE_specter-run"), args)
}

#[test]
fn impossible_host_path_settings_are_refused() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let too_many = (cores + 1).to_string();
    for command in ["generate", "bench"] {
        let mut base = vec![command, "no-such.specter"];
        if command == "bench" {
            base.extend(["--case", "ds_high"]);
        } else {
            base.extend(["--prompt-ids", "1,2,3"]);
        }
        let with = |extra: &[&str]| {
            let mut all = base.clone();
            all.extend_from_slice(extra);
            specter_run(&all)
        };
        assert_clean_failure(
            &with(&["--host-experts", "auto", "--host-threads", "0"]),
            &["--host-threads 0"],
        );
        assert_clean_failure(
            &with(&["--host-experts", "auto", "--host-threads", &too_many]),
            &["cores"],
        );
        if command == "generate" {
            // bench takes `--host-threads` alone: it sets its hybrid modes' threads.
            assert_clean_failure(&with(&["--host-threads", "1"]), &["--host-experts auto"]);
        }
        for bad in ["0", "-25", "fast", "inf", "NaN"] {
            let arg = format!("--link-gbps={bad}");
            assert_clean_failure(
                &with(&["--host-experts", "auto", &arg]),
                &["positive number of GB/s"],
            );
        }
        assert_clean_failure(&with(&["--host-experts", "sometimes"]), &["sometimes"]);
    }
}
