# bash completion for rbd-reconciler 0.1.0; generated from the CLI's
# parser by scripts/gen-manpage.py: do not edit. Install as
# /usr/share/bash-completion/completions/rbd-reconciler (or source it).
_rbd_reconciler() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    case $prev in
        --config) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        --csi-endpoint) COMPREPLY=(); return ;;
        --deadline) COMPREPLY=(); return ;;
        --log-format) COMPREPLY=($(compgen -W "auto journal json plain" -- "$cur")); return ;;
        --new-key-file) COMPREPLY=(); return ;;
        --output) COMPREPLY=($(compgen -W "human json" -- "$cur")); return ;;
        --reason) COMPREPLY=(); return ;;
        --step-timeout) COMPREPLY=(); return ;;
        -c) COMPREPLY=($(compgen -f -- "$cur")); return ;;
        -o) COMPREPLY=($(compgen -W "human json" -- "$cur")); return ;;
    esac
    # The command is the first word that is not an option or an option's value.
    local i word cmd="" skip=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if ((skip)); then skip=0; continue; fi
        case " --config --csi-endpoint --deadline --log-format --new-key-file --output --reason --step-timeout -c -o " in *" $word "*) skip=1; continue ;; esac
        [[ $word == -* ]] && continue
        cmd=$word; break
    done
    local opts paths
    case $cmd in
        "") COMPREPLY=($(compgen -W "-h --help --version -c --config -v --verbose validate plan apply release run allow-removal explain takeover recover rotate-key status source fleet" -- "$cur"))
            return ;;
        validate) opts="-h --help -o --output -c --config -v --verbose"; paths=1 ;;
        plan) opts="-h --help -o --output -c --config -v --verbose"; paths=1 ;;
        apply) opts="-h --help -o --output -c --config -v --verbose"; paths=1 ;;
        release) opts="-h --help -o --output --all --orphans --dry-run --step-timeout --deadline -c --config -v --verbose"; paths=1 ;;
        run) opts="-h --help --allow-mass-removal --log-format --csi-endpoint -c --config -v --verbose"; paths=0 ;;
        allow-removal) opts="-h --help --all -c --config -v --verbose"; paths=0 ;;
        explain) opts="-h --help -o --output -c --config -v --verbose"; paths=0 ;;
        takeover) opts="-h --help --yes-i-am-sure -c --config -v --verbose"; paths=0 ;;
        recover) opts="-h --help --leave --reclaim --yes-i-am-sure -c --config -v --verbose"; paths=0 ;;
        rotate-key) opts="-h --help --new-key-file -c --config -v --verbose"; paths=0 ;;
        status) opts="-h --help -o --output -c --config -v --verbose"; paths=1 ;;
        source) opts="-h --help --reason -o --output -c --config -v --verbose"; paths=0 ;;
        fleet) opts="-h --help -o --output -c --config -v --verbose"; paths=0 ;;
        *) return ;;
    esac
    if [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif ((paths)); then
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}
complete -o filenames -F _rbd_reconciler rbd-reconciler
