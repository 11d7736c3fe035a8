//! An agent's registrations, by NIXL's descriptors: registering (repeats of a
//! DRAM or VRAM descriptor counted), deregistering (waiting for transfers), and
//! finding the registration that holds a descriptor.

use nixl::{MemKind, RegisterOptions, Registration};

use super::{CAgent, Reg, DEREGISTER_WAIT};
use crate::lists::{mem, DescList, OptArgs, RegDesc};
use crate::runtime::{block_on, Locked};
use crate::status::{Failure, Outcome};

impl CAgent {
    /// Backends (ours) that serve `kind`, among the created ones or the hinted ones.
    fn serving(&self, kind: MemKind, hint: &[&'static str]) -> Vec<&'static str> {
        let setup = self.setup.locked();
        setup
            .attached
            .iter()
            .filter(|a| hint.is_empty() || hint.contains(&a.name))
            .filter(|a| {
                let c = a.backend.capabilities();
                match kind {
                    MemKind::Dram => c.dram,
                    MemKind::Vram { .. } => c.vram,
                    MemKind::File { .. } => c.file,
                }
            })
            .map(|a| a.name)
            .collect()
    }

    /// NIXL's `registerMem`: each descriptor becomes a registration, with the hinted
    /// backends or every backend serving its memory type. All or none.
    ///
    /// # Errors
    /// NOT_FOUND when no backend serves the memory type; the registration's error.
    pub fn register(&self, list: &DescList, opt: &OptArgs) -> Outcome {
        if list.descs.is_empty() {
            return Ok(());
        }
        let kind0 = list.kind(0)?;
        let serving = self.serving(kind0, &opt.backends);
        if serving.is_empty() {
            return Err(Failure::not_found(format!(
                "register memory: no backend of agent {:?} serves {} memory",
                self.name,
                mem::NAMES[list.mem as usize].trim_end_matches('\0')
            )));
        }
        let agent = self.agent()?;
        let _one = self.reg_op.locked();
        let options = RegisterOptions {
            backends: Some(serving.iter().map(|s| (*s).to_owned()).collect()),
        };
        let mut made: Vec<Reg> = Vec::with_capacity(list.descs.len());
        for d in &list.descs {
            // NIXL registers the same descriptor again without complaint (nixl-sys'
            // RAII handles and Dynamo's layouts do); it counts once more here, and
            // the memory stays registered until the last of them is deregistered.
            // Not files: a descriptor number may name another file by now.
            let same = (list.mem != mem::FILE)
                .then(|| self.same(list.mem, d))
                .flatten();
            if let Some(same) = same {
                made.push(Reg {
                    mem: list.mem,
                    desc: d.clone(),
                    reg: same,
                    again: true,
                });
                continue;
            }
            let r = memory(list.mem, d).and_then(|m| Ok(agent.register_with(m, &options)?));
            match r {
                Ok(reg) => made.push(Reg {
                    mem: list.mem,
                    desc: d.clone(),
                    reg,
                    again: false,
                }),
                Err(e) => {
                    for r in made.iter().filter(|r| !r.again) {
                        if let Err(e) = agent.deregister(&r.reg) {
                            tracing::warn!(error = %e, "rolling back a registration");
                        }
                    }
                    return Err(e);
                }
            }
        }
        self.regs.locked().extend(made);
        Ok(())
    }

    /// NIXL's `deregisterMem`: each descriptor names a registration by (address,
    /// length, device); a transfer still using it is waited for (bounded).
    ///
    /// # Errors
    /// NOT_FOUND for a descriptor that names no registration; BACKEND when a
    /// transfer keeps the memory past the bound.
    pub fn deregister(&self, list: &DescList) -> Outcome {
        let agent = self.agent()?;
        let _one = self.reg_op.locked();
        let mut picked = Vec::with_capacity(list.descs.len());
        {
            let regs = self.regs.locked();
            for d in &list.descs {
                match self.same_in(&regs, list.mem, d) {
                    Some(r) => picked.push(r),
                    None => {
                        return Err(Failure::not_found(format!(
                            "deregister memory: no registration at {:#x} of {} bytes, device {}",
                            d.addr, d.len, d.dev
                        )))
                    }
                }
            }
        }
        for reg in picked {
            let last = {
                let mut regs = self.regs.locked();
                let Some(i) = regs.iter().position(|r| r.reg.id() == reg.id()) else {
                    continue;
                };
                let shared = regs.iter().filter(|r| r.reg.id() == reg.id()).count() > 1;
                if shared {
                    regs.remove(i);
                }
                !shared
            };
            if last {
                // Transfers released while in flight are being cancelled by their
                // backend: wait for it to let go.
                block_on(agent.deregister_when_idle(&reg, DEREGISTER_WAIT))??;
                self.regs.locked().retain(|r| r.reg.id() != reg.id());
            }
        }
        Ok(())
    }

    /// The registration of exactly this descriptor, if any.
    fn same(&self, mem: u32, d: &RegDesc) -> Option<Registration> {
        self.same_in(&self.regs.locked(), mem, d)
    }

    fn same_in(&self, regs: &[Reg], mem: u32, d: &RegDesc) -> Option<Registration> {
        regs.iter()
            .find(|r| {
                r.mem == mem && r.desc.addr == d.addr && r.desc.len == d.len && r.desc.dev == d.dev
            })
            .map(|r| r.reg.clone())
    }

    /// The registration holding `d` of memory type `mem`.
    pub(super) fn registration_for(&self, mem: u32, d: &RegDesc) -> Option<Registration> {
        let regs = self.regs.locked();
        regs.iter()
            .find(|r| r.mem == mem && r.desc.addr == d.addr && r.desc.len == d.len)
            .or_else(|| {
                regs.iter().find(|r| {
                    r.mem == mem
                        && r.desc.dev == d.dev
                        && r.desc.addr <= d.addr
                        && d.addr.saturating_add(d.len) <= r.desc.addr + r.desc.len
                })
            })
            .map(|r| r.reg.clone())
    }
}

/// The memory a registration descriptor names.
fn memory(mem: u32, d: &RegDesc) -> Outcome<nixl::Memory> {
    let kind = crate::lists::kind(mem, d.dev)?;
    Ok(match kind {
        MemKind::File { fd } => {
            let meta = String::from_utf8_lossy(&d.meta);
            match nixl_compat::memory::path_mode(&meta) {
                Some((o, path)) => nixl_compat::memory::path_memory(d.addr, d.len, fd, o, path)?,
                None => crate::memory::file(d.addr, d.len, fd)?,
            }
        }
        _ => crate::memory::caller(d.addr, d.len, kind)?,
    })
}
