//! Compiles every embedded kernel file with NVRTC and writes its PTX, so kernels can be checked
//! (and their register use read with `ptxas -v`) on a machine without a GPU.
//!
//! `cargo run --example kernel_ptx -- OUT_DIR [ARCH]` (ARCH defaults to sm_90). NVRTC is found on
//! the loader path; `CUDA_INCLUDE` names the directory holding `cuda_fp16.h`.

use specter::backend::cuda::{compile_source, KERNELS};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(args.next().unwrap_or_else(|| "ptx".into()));
    let arch = args.next().unwrap_or_else(|| "sm_90".into());
    std::fs::create_dir_all(&out)?;
    let mut failed = 0;
    for kernel in KERNELS {
        match compile_source(kernel, &arch, None) {
            Ok(ptx) => {
                let path = out.join(format!("{}.ptx", kernel.name));
                std::fs::write(&path, ptx.ptx)?;
                println!(
                    "{:<16} ok   {:.2} s  {}",
                    kernel.name,
                    ptx.compile_seconds,
                    path.display()
                );
            }
            Err(err) => {
                failed += 1;
                println!("{:<16} FAIL {err}", kernel.name);
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} kernel file(s) failed to compile");
    }
    Ok(())
}
