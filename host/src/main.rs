//! The `les` command-line tool.

fn main() {
    eprintln!(
        "les {}: no subcommands are available in this build yet",
        env!("CARGO_PKG_VERSION")
    );
    std::process::exit(2);
}
