//! The tools of `specter-run` besides `generate` and `serve`, as a library so that their tests
//! call them directly: the paper's benchmark protocol ([`bench`](mod@bench)), the depth sweep
//! behind `profile` ([`profile`]), the route-fidelity probe ([`probe`]), quality against a
//! reference bundle ([`eval`]), the demo ([`demo`]) and the machine report ([`doctor`]). They build on the runtime (`specter`) and return its
//! [`specter::Error`]; the binary (main.rs and the modules it declares) parses arguments, maps
//! the environment onto options and prints.

pub mod bench;
pub mod demo;
pub mod doctor;
pub mod eval;
pub mod probe;
pub mod profile;
