//! The `les` command-line tool; see [`les::cli`].

fn main() -> std::process::ExitCode {
    les::cli::main()
}
