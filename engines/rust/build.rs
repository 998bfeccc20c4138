//! Asks the installed torch for its headers, libraries, C++ ABI flag and version, compiles the
//! ATen shim (C++20) with `cc`, and records what built the module for `BUILD`.
use std::{env, process::Command};

const PROBE: &str = r#"
import sys, sysconfig, torch
from torch.utils import cpp_extension as ce
print("abi=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
print("torch=" + torch.__version__)
print("python=" + sys.version.split()[0])
print("pyinc=" + sysconfig.get_paths()["include"])
for p in ce.include_paths(): print("inc=" + p)
for p in ce.library_paths(): print("lib=" + p)
"#;

fn python() -> String {
    env::var("PYO3_PYTHON")
        .or_else(|_| env::var("VIRTUAL_ENV").map(|v| format!("{v}/bin/python")))
        .unwrap_or_else(|_| "python3".into())
}

fn main() {
    println!("cargo:rerun-if-changed=csrc/aten.cpp");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let py = python();
    let out = Command::new(&py).args(["-c", PROBE]).output().unwrap_or_else(|e| panic!("cannot run {py}: {e}"));
    if !out.status.success() {
        panic!("{py} could not import torch:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let (mut abi, mut pyinc, mut incs, mut libs) = (String::from("1"), String::new(), vec![], vec![]);
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        match line.split_once('=') {
            Some(("abi", v)) => abi = v.into(),
            Some(("pyinc", v)) => pyinc = v.into(),
            Some(("inc", v)) => incs.push(v.to_string()),
            Some(("lib", v)) => libs.push(v.to_string()),
            Some(("torch", v)) => println!("cargo:rustc-env=DECODEBENCH_RS_TORCH={v}"),
            Some(("python", v)) => println!("cargo:rustc-env=DECODEBENCH_RS_PYTHON={v}"),
            _ => {}
        }
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc).arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    println!("cargo:rustc-env=DECODEBENCH_RS_RUSTC={}", version.unwrap_or_else(|_| "unknown".into()));

    let mut build = cc::Build::new();
    build.cpp(true).file("csrc/aten.cpp").flag("-std=c++20").define("_GLIBCXX_USE_CXX11_ABI", abi.as_str()).include(&pyinc).warnings(false);
    for i in &incs {
        build.include(i);
    }
    build.compile("decodebench_aten");
    for l in &libs {
        println!("cargo:rustc-link-search=native={l}");
    }
    for lib in ["torch_python", "torch", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}
